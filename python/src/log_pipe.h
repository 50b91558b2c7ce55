#pragma once

namespace layercast::python {

// Routes the worker library's log lines into the pipe whose write end is
// `fd`, one per line: the spdlog level's number, a space, the message
// (line breaks folded into spaces). The package reads the other end on a
// Python thread of its own and hands each line to the "layercast" logger
// (layercast/__init__.py). Never through the GIL on the library's threads:
// one of them may log while holding a lock that a thread holding the GIL
// waits for. A line the reader is too far behind to take (the pipe full)
// is dropped rather than blocking the thread that logs.
void RouteLogsToPipe(int fd);

}  // namespace layercast::python
