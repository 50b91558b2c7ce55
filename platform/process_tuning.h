#pragma once

namespace layercast {

// Keeps chunk-sized allocations (up to 4 MiB: gRPC's receive slices on a
// worker, cast chunks on a shard) in the malloc heap instead of a fresh
// mmap each. glibc otherwise maps, faults in, zeroes and unmaps every 1 MiB
// chunk; on loopback that was a quarter of a worker's CPU
// (bench/gather_bench with and without it). Freed memory above 64 MiB is
// still returned to the system. For processes layercast owns (the shard, the
// CLI, gather_bench); a library must not change its host's allocator, so
// workers embedding client/ decide for themselves. Call once, first in main.
void KeepChunkBuffersInHeap();

// Turns off Abseil's lock-order graph. Debian builds Abseil without NDEBUG, so every absl::Mutex
// lock (gRPC's own locks among them) records and checks lock order in one graph behind a global
// lock; `perf` of a serving shard put GraphCycles at about 1% of its samples. The tests keep the
// checks: the test binaries never call this, and the tests that start the programs set
// LAYERCAST_LOCK_ORDER_CHECKS=1, which the programs pass on as
// `keep_lock_order_checks`. For processes layercast owns, as above.
void SkipLockOrderChecks();

// Both (the second unless `keep_lock_order_checks`), for the programs
// layercast owns: first in main. The program reads its environment; the
// libraries never do.
void TuneOwnProcess(bool keep_lock_order_checks);

}  // namespace layercast
