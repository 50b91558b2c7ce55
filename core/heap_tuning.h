#pragma once

namespace layercast {

// Keeps chunk-sized allocations (up to 4 MiB: gRPC's receive slices on a
// worker, cast chunks on a shard) in the malloc heap instead of a fresh
// mmap each. glibc otherwise maps, faults in, zeroes and unmaps every 1 MiB
// chunk; on loopback that was a quarter of a worker's CPU
// (bench/gather_bench with and without it). Freed memory above 64 MiB is
// still returned to the system. For processes layercast owns (the shard, the
// CLI, benchmarks); a library must not change its host's allocator, so
// workers embedding client/ decide for themselves. Call once, first in main.
void KeepChunkBuffersInHeap();

}  // namespace layercast
