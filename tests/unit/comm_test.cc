// The single-rank Communicator and make_communicator's choice (no launcher in this process).
#include "tiermem/communicator.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

#include "tiermem/error.h"

namespace tiermem {
namespace {

TEST(Comm, SingleRankCollectivesAreCopies) {
  auto c = make_single_communicator();
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->world_size(), 1);
  EXPECT_EQ(c->backend(), "single");
  std::vector<float> a = {1, 2, 3}, b(3, 0);
  c->all_gather(a.data(), b.data(), 3, DType::kF32);
  EXPECT_EQ(a, b);
  std::fill(b.begin(), b.end(), 0.0f);
  c->reduce_scatter(a.data(), b.data(), 3, DType::kF32, ReduceOp::kAvg);
  EXPECT_EQ(a, b);
  auto h = c->all_reduce_async(a.data(), a.data(), 3, DType::kF32, ReduceOp::kSum);
  EXPECT_TRUE(h.test());
  EXPECT_EQ(a, (std::vector<float>{1, 2, 3}));
  c->broadcast(a.data(), 3, DType::kF32, 0);
  EXPECT_THROW(c->broadcast(a.data(), 3, DType::kF32, 1), CommError);
  std::vector<std::int32_t> i(2);
  EXPECT_THROW(c->all_reduce(i.data(), i.data(), 2, DType::kI32, ReduceOp::kSum), CommError);
  c->barrier();
}

TEST(Comm, MakeCommunicatorPicksSingleWithoutLauncher) {
  if (std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("WORLD_SIZE")) {
    GTEST_SKIP() << "running under a launcher";
  }
  auto c = make_communicator();
  EXPECT_EQ(c->backend(), "single");
  CommOptions o;
  o.backend = "carrier-pigeon";
  EXPECT_THROW(make_communicator(o), NotSupportedError);
  if (!communicator_backend_built("nccl")) {
    EXPECT_THROW(make_nccl_communicator(), NotSupportedError);
  }
}

TEST(Comm, WorldSizeWithoutMpirunIsAClearError) {
  if (std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE")) GTEST_SKIP() << "under mpirun";
  setenv("WORLD_SIZE", "4", 1);
  CommOptions o;
  o.backend = "single";
  EXPECT_THROW(make_communicator(o), CommError);
  unsetenv("WORLD_SIZE");
}

}  // namespace
}  // namespace tiermem
