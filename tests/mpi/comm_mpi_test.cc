// Collectives across real ranks (mpirun -np 1/2/4): every operation checked against values each
// rank can compute on its own.
#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

#include "mpi/mpi_env.h"
#include "tiermem/error.h"

namespace tiermem {
namespace {

using testing::world_comm;

TEST(CommMpi, BackendMatchesLauncher) {
  Communicator& c = world_comm();
  if (std::getenv("OMPI_COMM_WORLD_SIZE")) {
    EXPECT_EQ(c.backend(), "mpi");
    EXPECT_EQ(c.world_size(), std::atoi(std::getenv("OMPI_COMM_WORLD_SIZE")));
    EXPECT_EQ(c.rank(), std::atoi(std::getenv("OMPI_COMM_WORLD_RANK")));
  } else {
    EXPECT_EQ(c.backend(), "single");
  }
}

TEST(CommMpi, AllGather) {
  Communicator& c = world_comm();
  const int W = c.world_size(), r = c.rank();
  const std::size_t n = 1000;
  std::vector<float> send(n), recv(n * W, -1.0f);
  for (std::size_t i = 0; i < n; ++i) send[i] = static_cast<float>(r * 100000 + i);
  c.all_gather(send.data(), recv.data(), n, DType::kF32);
  for (int q = 0; q < W; ++q)
    for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(recv[q * n + i], static_cast<float>(q * 100000 + i));
  // In place, 16-bit raw elements.
  std::vector<std::uint16_t> h(W * 3, 0);
  for (int i = 0; i < 3; ++i) h[r * 3 + i] = static_cast<std::uint16_t>(r * 10 + i);
  c.all_gather(h.data() + r * 3, h.data(), 3, DType::kBF16);
  for (int q = 0; q < W; ++q)
    for (int i = 0; i < 3; ++i) ASSERT_EQ(h[q * 3 + i], q * 10 + i);
}

TEST(CommMpi, ReduceScatterSumAndAvg) {
  Communicator& c = world_comm();
  const int W = c.world_size(), r = c.rank();
  const std::size_t n = 257;
  std::vector<float> send(n * W), recv(n);
  for (std::size_t i = 0; i < send.size(); ++i) send[i] = static_cast<float>(i) + static_cast<float>(r);
  c.reduce_scatter(send.data(), recv.data(), n, DType::kF32, ReduceOp::kSum);
  const float rank_sum = static_cast<float>(W * (W - 1) / 2);
  for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(recv[i], static_cast<float>(W) * (r * n + i) + rank_sum);
  auto h = c.reduce_scatter_async(send.data(), recv.data(), n, DType::kF32, ReduceOp::kAvg);
  h.wait();
  for (std::size_t i = 0; i < n; ++i) ASSERT_FLOAT_EQ(recv[i], (r * n + i) + rank_sum / W);
}

TEST(CommMpi, AllReduceBroadcastBarrierAsync) {
  Communicator& c = world_comm();
  const int W = c.world_size(), r = c.rank();
  std::vector<float> x(100, static_cast<float>(r + 1));
  auto h = c.all_reduce_async(x.data(), x.data(), x.size(), DType::kF32, ReduceOp::kSum);
  while (!h.test()) {
  }
  EXPECT_FALSE(h.pending());
  for (float v : x) ASSERT_EQ(v, static_cast<float>(W * (W + 1) / 2));
  std::vector<std::int32_t> b(7, r == W - 1 ? 42 : 0);
  c.broadcast(b.data(), b.size(), DType::kI32, W - 1);
  for (auto v : b) ASSERT_EQ(v, 42);
  c.barrier();
  // Several collectives in flight at once, completed in reverse order.
  std::vector<std::vector<float>> bufs(4, std::vector<float>(64, 1.0f));
  std::vector<CommHandle> hs;
  for (auto& buf : bufs) hs.push_back(c.all_reduce_async(buf.data(), buf.data(), 64, DType::kF32, ReduceOp::kSum));
  for (int i = 3; i >= 0; --i) hs[i].wait();
  for (auto& buf : bufs) ASSERT_EQ(buf[63], static_cast<float>(W));
  EXPECT_THROW(c.broadcast(b.data(), 1, DType::kI32, W), CommError);
}

}  // namespace
}  // namespace tiermem
