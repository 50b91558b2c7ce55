#include "server/version_gate.h"

#include <gtest/gtest.h>

namespace layercast::server {
namespace {

TEST(VersionGateTest, RunsWaitersWhenTheirVersionArrives) {
  VersionGate gate(3);
  int ran = 0;
  EXPECT_EQ(gate.Wait(2, [&] { ran += 1; }), 0u);  // already there: runs at once
  EXPECT_EQ(ran, 1);
  const uint64_t five = gate.Wait(5, [&] { ran += 10; });
  const uint64_t seven = gate.Wait(7, [&] { ran += 100; });
  EXPECT_EQ(gate.waiting(), 2u);
  gate.Advance(4);
  EXPECT_EQ(ran, 1);
  gate.Advance(6);
  EXPECT_EQ(ran, 11);
  EXPECT_FALSE(gate.Cancel(five));
  EXPECT_TRUE(gate.Cancel(seven));
  gate.Advance(9);
  EXPECT_EQ(ran, 11);
  gate.Advance(1);  // never lowers
  EXPECT_EQ(gate.version(), 9u);
}

}  // namespace
}  // namespace layercast::server
