#pragma once

// The cast-error measurement the AVX-512 kernels fuse into their casts
// (core/cast_avx512.cc for bfloat16 and float16, core/fp8_avx512.cc for the
// 8-bit floats). Include only from files compiled for AVX-512 F and BW.

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>

#include "core/cast_error.h"
#include "core/cast_kernels.h"
#include "core/x86_intrinsics.h"

namespace layercast::internal::avx512 {

// Bucket counts four bits each, all eight in a lane: entry i of the table
// has a 1 in field j when bucket index i (cast_kernels.h) exceeds bound j,
// so one lookup and one add count every bucket. Every kNibbleFlush vectors,
// before a field can overflow, the nibbles move into bytes (the even
// buckets' and the odd ones'), and those into the CastError every
// kSumVectors vectors, before a byte can overflow (16 * 15 <= 255). The fp32
// sums of 240 terms a lane stay within about 2^-16 of exact.
inline constexpr int kTableEntries = 32;
inline constexpr int kNibbleFlush = 15;
inline constexpr int kSumVectors = 16 * kNibbleFlush;

constexpr std::array<uint32_t, kTableEntries> AboveTable() {
  std::array<uint32_t, kTableEntries> table{};
  for (int index = 0; index < kTableEntries; ++index) {
    for (int j = 0; j < BoundsExceeded(index); ++j) table[index] |= 1u << (4 * j);
  }
  return table;
}
inline constexpr std::array<uint32_t, kTableEntries> kAboveTable = AboveTable();
static_assert(kBucketIndexBelow == kTableEntries - 1);
static_assert(CastError::kBuckets == 8, "eight nibbles a lane");

// Calls body(add, sample), where add(kept, a, difference, overflowed,
// flushed, subnormal) adds to `*error`, by the end of the call, what a cast
// lost in the lanes of `kept`: |difference| (the cast less x, or its
// negation) over a (x's magnitude bits) each, and the counts of the rare
// kinds of loss the caller found among its 16 lanes. skip(normal) says
// whether a vector whose lanes in the normal range are `normal` goes
// unmeasured: one whose 16 lanes all are, outside the sample of one in
// error->sample_every such vectors, is counted unmeasured and not passed to
// add (the sample: a call's first vector and every sample_every-th after
// it). Callers count `elements` themselves.
// REQUIRES: a is nonzero in the lanes of `kept`, and their relative errors
// are at most 2^7 (the bucket table's last bucket; casts lose far less).
//
// Measuring from the registers a cast has just produced only pays when the
// accumulators stay in registers too: they are locals here, which `add`
// reaches by reference, and everything inlines (GCC keeps a class holding
// them in memory).
template <typename Body>
[[gnu::always_inline]] inline void MeasureLoss(CastError* error, Body&& body) {
  const __m512i table_low = _mm512_loadu_si512(kAboveTable.data());
  const __m512i table_high = _mm512_loadu_si512(kAboveTable.data() + 16);
  // The counts of the rare kinds of loss are scalars: 32 vector registers
  // hold the cast's constants and the accumulators below, and no more.
  uint64_t overflowed = 0, flushed = 0, subnormal = 0, measured = 0, unmeasured = 0;
  const uint32_t every = std::max<uint32_t>(1, error->sample_every);
  // The first vector of every call is measured, then every `every`-th: a
  // short call (a piece of 2048 elements) still has one.
  uint32_t countdown = 1;
  __m512i nibbles = _mm512_setzero_si512(), even_bytes = nibbles, odd_bytes = nibbles;
  __m512 sum = _mm512_setzero_ps();
  // The largest relative error's bits: errors are never negative, and such
  // floats order as their bits do, so an integer max leaves the FP pipes,
  // which the cast and the division keep busy, one operation fewer.
  __m512i max = _mm512_setzero_si512();
  int pending = 0, moves = 0;

  auto flush = [&]() __attribute__((always_inline)) {
    error->overflowed += overflowed;
    error->flushed_to_zero += flushed;
    error->became_subnormal += subnormal;
    error->measured += measured;
    error->unmeasured += unmeasured;
    // Bucket 2k is byte k of each even_bytes lane, 2k + 1 of odd_bytes, and
    // the nibbles not yet moved are bucket j's field j.
    alignas(64) uint8_t even[64], odd[64];
    alignas(64) uint32_t unmoved[16];
    _mm512_store_si512(even, even_bytes);
    _mm512_store_si512(odd, odd_bytes);
    _mm512_store_si512(unmoved, nibbles);
    for (int lane = 0; lane < 16; ++lane) {
      for (int k = 0; k < 4; ++k) {
        error->above[2 * k] += even[4 * lane + k] + ((unmoved[lane] >> (8 * k)) & 0xF);
        error->above[2 * k + 1] += odd[4 * lane + k] + ((unmoved[lane] >> (8 * k + 4)) & 0xF);
      }
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, sum);
    for (float lane : lanes) error->relative_error_sum += lane;
    _mm512_store_si512(lanes, max);
    for (float lane : lanes) error->max_relative_error = std::max(error->max_relative_error, lane);
    overflowed = flushed = subnormal = measured = unmeasured = 0;
    nibbles = even_bytes = odd_bytes = _mm512_setzero_si512();
    sum = _mm512_setzero_ps();
    max = _mm512_setzero_si512();
    pending = moves = 0;
  };

  auto add = [&](__mmask16 kept, __m512i a, __m512 difference, unsigned lanes_overflowed,
                 unsigned lanes_flushed, unsigned lanes_subnormal) __attribute__((always_inline)) {
    overflowed += lanes_overflowed;
    flushed += lanes_flushed;
    subnormal += lanes_subnormal;
    measured += std::popcount(static_cast<unsigned>(kept));
    const __m512 relative =
        _mm512_maskz_div_ps(kept,
                            _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(difference),
                                                                 _mm512_set1_epi32(0x7FFFFFFF))),
                            _mm512_castsi512_ps(a));
    const __m512i index = _mm512_min_epu32(
        _mm512_srai_epi32(_mm512_add_epi32(_mm512_castps_si512(relative),
                                           _mm512_set1_epi32(-1 - (kBucketIndexBias << 23))),
                          23),
        _mm512_set1_epi32(kBucketIndexBelow));
    nibbles = _mm512_add_epi32(nibbles, _mm512_permutex2var_epi32(table_low, index, table_high));
    sum = _mm512_add_ps(sum, relative);
    max = _mm512_max_epu32(max, _mm512_castps_si512(relative));
    if (++pending == kNibbleFlush) {
      const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
      even_bytes = _mm512_add_epi8(even_bytes, _mm512_and_si512(nibbles, low_nibbles));
      odd_bytes =
          _mm512_add_epi8(odd_bytes, _mm512_and_si512(_mm512_srli_epi32(nibbles, 4), low_nibbles));
      nibbles = _mm512_setzero_si512();
      pending = 0;
      if (++moves == kSumVectors / kNibbleFlush) flush();
    }
  };

  // Whether a vector whose lanes are `normal` (all 16: it stays in the
  // normal range) goes unmeasured: every vector counts towards the sample's
  // stride, so the normal ones are measured a little more often than one
  // in `every` where rare ones are many. A countdown, not a modulo, and
  // without a branch of its own: the caller's is the only one a skipped
  // vector costs. (Counting only normal vectors costs an operation more a
  // vector, measured: a few percent of the cast.)
  auto skip = [&](__mmask16 normal) __attribute__((always_inline)) {
    const bool in_sample = --countdown == 0;
    countdown = in_sample ? every : countdown;
    const bool skipped = normal == 0xFFFF && !in_sample;
    unmeasured += skipped ? 16 : 0;
    return skipped;
  };

  body(add, skip);
  flush();
}

}  // namespace layercast::internal::avx512
