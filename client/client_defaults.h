#pragma once

#include <chrono>

namespace layercast::client {

// The worker library's defaults, written once: its option structs, the
// `layercast` tool's flags and the Python package (which reads them through
// its native module, `_layercast.defaults`, in seconds) all take them from
// here.

// A layer's gather or pull, retries included (GatherOptions::timeout,
// MirrorOptions::layer_timeout, a layer's digests): long enough to wait out
// a rolling restart of a shard.
inline constexpr std::chrono::milliseconds kLayerTimeout{60000};
// Connecting to a shard set: every shard answering GetManifest, shards
// still loading waited for (ShardSetOptions::connect_timeout).
inline constexpr std::chrono::milliseconds kConnectTimeout{30000};
// A publish to every shard, retries included (PublishOptions::timeout).
inline constexpr std::chrono::milliseconds kPublishTimeout{120000};
// A layer's gradient push to one shard, retries included
// (GradientSinkOptions::timeout).
inline constexpr std::chrono::milliseconds kPushTimeout{120000};
// How long a mirror's long poll for a newer version lasts before it is
// asked again (MirrorOptions::poll).
inline constexpr std::chrono::milliseconds kMirrorPoll{10000};
// How often a mirror with fallbacks probes its source (MirrorOptions::probe).
inline constexpr std::chrono::milliseconds kMirrorProbe{500};

}  // namespace layercast::client
