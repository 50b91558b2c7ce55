// The POSIX file seam's private files and permissions: CreatePrivate makes a
// new 0600 file whatever the umask and never follows or reuses what is at the
// name; OpenForRead reports the permissions of the file it opened.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "platform/file_system.h"

namespace layercast {
namespace {

using std::filesystem::perms;
using ::testing::HasSubstr;

std::string MakeTestDir() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) /
                                    ("layercast_file_system_" + std::to_string(getpid())) /
                                    (std::string(info->test_suite_name()) + "." + info->name());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

absl::Status WriteText(WritableFile& file, const std::string& text) {
  if (absl::Status appended = file.Append(
          std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
      !appended.ok()) {
    return appended;
  }
  return file.Close();
}

TEST(PosixFileSystemTest, CreatePrivateMakesANewFileOnlyItsOwnerMayUseWhateverTheUmask) {
  const std::string path = MakeTestDir() + "/secret";
  const mode_t old_umask = umask(0);
  absl::StatusOr<std::unique_ptr<WritableFile>> file = DefaultFileSystem().CreatePrivate(path);
  umask(old_umask);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_TRUE(WriteText(**file, "data").ok());
  EXPECT_EQ(std::filesystem::status(path).permissions(), perms::owner_read | perms::owner_write);
  EXPECT_EQ(ReadText(path), "data");
}

TEST(PosixFileSystemTest, CreatePrivateRefusesAnExistingFileAndLeavesIt) {
  const std::string path = MakeTestDir() + "/taken";
  std::ofstream(path) << "someone else's";
  absl::StatusOr<std::unique_ptr<WritableFile>> file = DefaultFileSystem().CreatePrivate(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kAlreadyExists) << file.status();
  EXPECT_THAT(std::string(file.status().message()), HasSubstr(path));
  EXPECT_EQ(ReadText(path), "someone else's");
}

TEST(PosixFileSystemTest, CreatePrivateNeverFollowsASymbolicLink) {
  const std::string dir = MakeTestDir();
  const std::string target = dir + "/target";
  std::ofstream(target) << "precious";
  std::filesystem::create_symlink(target, dir + "/link");
  std::filesystem::create_symlink(dir + "/would-be-created", dir + "/dangling");

  EXPECT_EQ(DefaultFileSystem().CreatePrivate(dir + "/link").status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(ReadText(target), "precious");
  EXPECT_EQ(DefaultFileSystem().CreatePrivate(dir + "/dangling").status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_FALSE(std::filesystem::exists(dir + "/would-be-created"))
      << "a dangling link's target was created";
}

TEST(PosixFileSystemTest, OpenForReadReportsTheModeAndOwnerOfTheOpenedFile) {
  const std::string path = MakeTestDir() + "/file";
  std::ofstream(path) << "x";
  std::filesystem::permissions(path, perms::owner_read | perms::group_read);
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> file = DefaultFileSystem().OpenForRead(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->permissions().mode, 0440u);
  EXPECT_EQ((*file)->permissions().owner_uid, geteuid());

  // What was opened, not what the path names later.
  std::filesystem::permissions(path, perms::owner_all | perms::others_all);
  EXPECT_EQ((*file)->permissions().mode, 0440u);
}

}  // namespace
}  // namespace layercast
