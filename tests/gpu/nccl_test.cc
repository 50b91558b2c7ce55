// The hierarchical gather over NCCL: one rank in process (K = 1), K ranks as
// K processes when there are K GPUs, and set-up that cannot complete ends in
// DEADLINE_EXCEEDED instead of a hang.

#include "client/gpu/nccl_comm.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <thread>

#include "absl/strings/str_join.h"
#include "client/gpu/nccl_unique_id.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/test_shards.h"

extern char** environ;

namespace layercast::gpu {
namespace {

constexpr char kModel[] = "llama:layers=3,hidden=256,ffn=704,vocab=1000,seed=11";

std::string FreshIdPath() {
  char dir[] = "/tmp/layercast-nccl-XXXXXX";
  EXPECT_NE(::mkdtemp(dir), nullptr);
  return std::string(dir) + "/nccl-id";
}

TEST(NcclTest, OneRankLandsEveryLayerBitIdentical) {
  LAYERCAST_SKIP_WITHOUT_GPU();
  TestShards shards(2, kModel);
  std::string summary;
  const absl::Status status = RunNcclRank(0, 1, FreshIdPath(), shards.addresses(), &summary);
  ASSERT_TRUE(status.ok()) << status;
  std::printf("%s\n", summary.c_str());
}

TEST(NcclTest, MissingRanksAreDeadlineExceededNotAHang) {
  LAYERCAST_SKIP_WITHOUT_GPU();
  absl::StatusOr<ncclUniqueId> id = ShareNcclUniqueId(0, FreshIdPath(), std::chrono::seconds(1));
  ASSERT_TRUE(id.ok()) << id.status();
  const auto start = std::chrono::steady_clock::now();
  // Rank 0 of 2; rank 1 never comes.
  auto comm = NcclComm::Create(0, 2, *id, 0, std::chrono::seconds(3));
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
  EXPECT_NE(comm.status().message().find("rank 0 of 2"), absl::string_view::npos) << comm.status();
  EXPECT_LT(took, std::chrono::seconds(30)) << "the abort itself must be bounded";
}

TEST(NcclTest, RankOutOfRangeIsInvalidArgument) {
  ncclUniqueId id = {};
  EXPECT_EQ(NcclComm::Create(2, 2, id, 0, std::chrono::seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Starts `argv` and returns its pid, or -1.
pid_t Spawn(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const std::string& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) return -1;
  return pid;
}

// Waits for `pid` until `deadline`; its exit code, or -1 (killed) on timeout.
int WaitFor(pid_t pid, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

TEST(NcclTest, SeveralProcessesOneGpuEachCompleteEveryLayer) {
  LAYERCAST_SKIP_WITHOUT_GPU();
  const int devices = *CudaDeviceCount();
  if (devices < 2) {
    GTEST_SKIP() << "K > 1 needs at least 2 CUDA devices (NCCL wants one GPU per rank): "
                 << "this machine has " << devices;
  }
  const int k = std::min(devices, 8);
  TestShards shards(2, kModel);
  const std::string id_path = FreshIdPath();
  const std::string list = absl::StrJoin(shards.addresses(), ",");
  std::vector<pid_t> pids;
  for (int rank = 0; rank < k; ++rank) {
    pids.push_back(Spawn(
        {LAYERCAST_NCCL_RANK_HELPER, std::to_string(rank), std::to_string(k), id_path, list}));
    ASSERT_GT(pids.back(), 0) << "cannot start " << LAYERCAST_NCCL_RANK_HELPER;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(150);
  for (int rank = 0; rank < k; ++rank) {
    EXPECT_EQ(WaitFor(pids[rank], deadline), 0)
        << "rank " << rank << " of " << k << " (its stderr above says why)";
  }
}

}  // namespace
}  // namespace layercast::gpu
