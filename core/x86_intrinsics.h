#pragma once

// <immintrin.h> for the per-instruction-set kernel files. GCC 12 warns
// inside its own AVX-512 headers (_mm512_undefined_epi32, GCC bug 105593:
// -Wmaybe-uninitialized, and -Wuninitialized once a kernel inlines more);
// the location it reports is the header, hence the pragma around the
// include rather than in the kernels.

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
