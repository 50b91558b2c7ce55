#pragma once

// Whether this build runs under AddressSanitizer or ThreadSanitizer: tests
// that measure memory (shadow memory and ASan's quarantine make RSS
// meaningless) or sweep every fp32 pattern (about 4x slower) do less.
// GCC says so with __SANITIZE_*__, clang only through __has_feature.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define LAYERCAST_UNDER_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define LAYERCAST_UNDER_SANITIZER 1
#endif
#endif

namespace layercast::testing {

#if defined(LAYERCAST_UNDER_SANITIZER)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif

}  // namespace layercast::testing
