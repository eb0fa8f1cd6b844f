// GEMM <-> collective pipelines (see tp_overlap.h). The pattern everywhere: start the
// collective asynchronously, do the independent GEMM, wait right before the result is used.
// On CUDA the c10d NCCL backend runs each collective on its own stream, ordered after the
// current stream with events, and work->wait() orders the current stream after it: no
// device-wide synchronize. On CPU the gloo backend runs them on its worker threads.
#include "tp_overlap.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <vector>

#include "trace.h"

namespace fastpar {
namespace {

using Work = c10::intrusive_ptr<c10d::Work>;

c10::intrusive_ptr<c10d::ProcessGroup> resolve(const std::string& group) {
  return c10d::resolve_process_group(group);
}

void check_gemm(const char* op, const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D (rows, K), got ", x.sizes());
  TORCH_CHECK(w.dim() == 2, op, ": w must be 2-D (N, K), got ", w.sizes());
  TORCH_CHECK(x.size(1) == w.size(1), op, ": x has K=", x.size(1), " but w has K=", w.size(1));
  TORCH_CHECK(x.device() == w.device(), op, ": x is on ", x.device(), ", w on ", w.device());
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), op, ": x is ", x.scalar_type(), ", w is ",
              w.scalar_type());
}

// out = x @ w^T written into `out` (a contiguous block of rows), traced as a GEMM.
void gemm_into(at::Tensor out, const at::Tensor& x, const at::Tensor& w, int64_t index) {
  trace_event("gemm_begin", index);
  at::mm_out(out, x, w.t());
  trace_event("gemm_end", index);
}

// One ring step as one grouped exchange: `send` goes to rank `next` while `recv` arrives from
// rank `prev`. Two separate p2p calls would hang under NCCL: a send blocks its stream until the
// peer's receive runs, so at tp=2 both ranks' sends wait on each other, and at tp>=3 the first
// p2p of each pair builds that pair's communicator, a cycle of blocking rendezvous. An all-to-all
// whose only non-empty splits are the two neighbours is NCCL's grouped send/receive on the
// group's own communicator (and gloo's alltoallv on CPU): both progress together, no new
// communicator, one work to wait for.
Work ring_exchange(c10d::ProcessGroup& pg, at::Tensor send, at::Tensor recv, int64_t next,
                   int64_t prev) {
  std::vector<int64_t> send_splits(pg.getSize(), 0), recv_splits(pg.getSize(), 0);
  send_splits[next] = send.size(0);
  recv_splits[prev] = recv.size(0);
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
  return pg.all_to_all_single(recv, send, recv_splits, send_splits);
#else
  return pg.alltoall_base(recv, send, recv_splits, send_splits);
#endif
}

// The logical collective an op performs, for tests that count what goes on the wire: its kind
// and the bytes of the whole tensor it gathers / reduces (e.g. an all-gather of S*B*H elements,
// however many ring steps or chunks carry it).
void trace_collective(const char* kind, const at::Tensor& whole) {
  trace_event(kind, whole.numel() * static_cast<int64_t>(whole.element_size()));
}

// Progress, not just order: "comm_pending" when a collective has not finished right after it
// was issued (it did not block), "comm_ready" when it has finished before anyone waited for it
// (it progressed while the GEMMs between ran). Polled only while tracing.
Work issued(Work work, int64_t index) {
  if (trace_enabled() && !work->isCompleted()) trace_event("comm_pending", index);
  return work;
}

void wait(Work& work, int64_t index) {
  if (trace_enabled() && work->isCompleted()) trace_event("comm_ready", index);
  work->wait();
  trace_event("comm_done", index);
}

}  // namespace

at::Tensor matmul_allreduce(const at::Tensor& x_, const at::Tensor& w, const std::string& group,
                            int64_t chunks) {
  check_gemm("matmul_allreduce", x_, w);
  TORCH_CHECK(chunks >= 1, "matmul_allreduce: chunks must be >= 1, got ", chunks);
  auto pg = resolve(group);
  const at::Tensor x = x_.contiguous();
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, w.size(0)}, x.options());
  chunks = std::max<int64_t>(1, std::min(chunks, rows));
  if (pg->getSize() > 1) trace_collective("coll:all_reduce", out);
  std::vector<Work> works;
  for (int64_t i = 0; i < chunks; ++i) {
    const int64_t lo = rows * i / chunks, hi = rows * (i + 1) / chunks;
    at::Tensor block = out.narrow(0, lo, hi - lo);  // contiguous rows: reduced in place
    gemm_into(block, x.narrow(0, lo, hi - lo), w, i);
    std::vector<at::Tensor> bufs{block};
    trace_event("comm_start", i);
    works.push_back(issued(pg->allreduce(bufs), i));
  }
  for (int64_t i = 0; i < chunks; ++i) wait(works[i], i);
  return out;
}

std::tuple<at::Tensor, at::Tensor> allgather_matmul(const at::Tensor& x_, const at::Tensor& w,
                                                    const std::string& group) {
  check_gemm("allgather_matmul", x_, w);
  auto pg = resolve(group);
  const int64_t tp = pg->getSize(), r = pg->getRank(), m = x_.size(0);
  const int64_t next = (r + 1) % tp, prev = (r + tp - 1) % tp;
  at::Tensor gathered = at::empty({tp * m, x_.size(1)}, x_.options());
  at::Tensor out = at::empty({tp * m, w.size(0)}, x_.options());
  gathered.narrow(0, r * m, m).copy_(x_);
  if (tp > 1) trace_collective("coll:all_gather", gathered);
  for (int64_t s = 0; s < tp; ++s) {
    // At step s this rank holds block (r - s) and receives block (r - s - 1) from prev.
    const int64_t cur = (r - s + tp) % tp, incoming = (r - s - 1 + 2 * tp) % tp;
    Work work;
    if (s + 1 < tp) {
      trace_event("comm_start", s);
      work = issued(ring_exchange(*pg, gathered.narrow(0, cur * m, m),
                                  gathered.narrow(0, incoming * m, m), next, prev), s);
    }
    gemm_into(out.narrow(0, cur * m, m), gathered.narrow(0, cur * m, m), w, s);
    if (work) wait(work, s);
  }
  return {out, gathered};
}

at::Tensor matmul_reducescatter(const at::Tensor& x_, const at::Tensor& w,
                                const std::string& group) {
  check_gemm("matmul_reducescatter", x_, w);
  auto pg = resolve(group);
  const int64_t tp = pg->getSize(), r = pg->getRank();
  TORCH_CHECK(x_.size(0) % tp == 0, "matmul_reducescatter: rows=", x_.size(0),
              " not divisible by tp=", tp);
  const at::Tensor x = x_.contiguous();
  const int64_t m = x.size(0) / tp, n = w.size(0);
  const int64_t next = (r + 1) % tp, prev = (r + tp - 1) % tp;
  // The running sum for block b starts on rank b+1 and travels the ring, gaining one partial
  // product per rank, so that it ends, complete, on rank b.
  at::Tensor out = at::empty({m, n}, x.options());
  at::Tensor partial[2] = {at::empty({m, n}, x.options()), at::empty({m, n}, x.options())};
  at::Tensor incoming = at::empty({m, n}, x.options());
  if (tp > 1) trace_event("coll:reduce_scatter", tp * m * n * static_cast<int64_t>(x.element_size()));
  Work work;
  for (int64_t s = 0; s < tp; ++s) {
    const int64_t b = (r - s - 1 + 2 * tp) % tp;  // == r at the last step
    at::Tensor acc = (s + 1 == tp) ? out : partial[s % 2];
    gemm_into(acc, x.narrow(0, b * m, m), w, s);  // overlaps the transfer of step s-1
    if (s > 0) {
      wait(work, s - 1);
      acc.add_(incoming);
    }
    if (s + 1 < tp) {
      trace_event("comm_start", s);
      work = issued(ring_exchange(*pg, acc, incoming, next, prev), s);
    }
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> column_linear_backward(
    const at::Tensor& grad_out_, const at::Tensor& input_, const at::Tensor& w,
    const std::string& group, bool sequence_parallel, bool need_input_grad,
    bool need_weight_grad, int64_t chunks) {
  check_gemm("column_linear_backward", input_, w);
  TORCH_CHECK(grad_out_.dim() == 2 && grad_out_.size(1) == w.size(0),
              "column_linear_backward: grad_out must be (rows, ", w.size(0), "), got ",
              grad_out_.sizes());
  TORCH_CHECK(chunks >= 1, "column_linear_backward: chunks must be >= 1, got ", chunks);
  auto pg = resolve(group);
  const int64_t tp = pg->getSize();
  const at::Tensor grad_out = grad_out_.contiguous(), input = input_.contiguous();
  const int64_t rows = grad_out.size(0);
  // Under SP the input is this rank's shard, gathered again here for the weight gradient, or
  // the whole gathered input the forward kept (rows == grad_out's): nothing to gather.
  const bool gathered = sequence_parallel && tp > 1 && input.size(0) == rows;
  TORCH_CHECK(gathered || input.size(0) * (sequence_parallel ? tp : 1) == rows,
              "column_linear_backward: input has ", input.size(0), " rows, grad_out ", rows,
              " (sequence_parallel=", sequence_parallel, ", tp=", tp, ")");
  const int64_t shard_rows = sequence_parallel ? rows / tp : rows;
  at::Tensor total = input, grad_input, grad_weight;
  std::vector<Work> reduce_works;
  Work gather_work;
  if (need_input_grad && sequence_parallel) {
    // The wgrad GEMM needs the whole sequence: gather it while the dgrad GEMM computes, then
    // reduce-scatter the dgrad while the wgrad GEMM computes.
    if (need_weight_grad && !gathered) {
      total = at::empty({rows, input.size(1)}, input.options());
      trace_event("comm_start", 0);
      trace_collective("coll:all_gather", total);
      gather_work = issued(pg->_allgather_base(total, const_cast<at::Tensor&>(input)), 0);
    }
    trace_event("gemm_begin", 0);
    at::Tensor partial = at::mm(grad_out, w);  // (rows, K): this rank's share of the sum
    trace_event("gemm_end", 0);
    if (gather_work) wait(gather_work, 0);
    grad_input = at::empty({shard_rows, input.size(1)}, input.options());
    trace_event("comm_start", 1);
    trace_collective("coll:reduce_scatter", partial);
    reduce_works.push_back(issued(pg->_reduce_scatter_base(grad_input, partial), 1));
  } else if (need_input_grad) {
    // Row chunks of the dgrad: each is all-reduced in place while the next chunk, and then the
    // wgrad GEMM, compute.
    grad_input = at::empty({rows, input.size(1)}, input.options());
    trace_collective("coll:all_reduce", grad_input);
    chunks = std::max<int64_t>(1, std::min(chunks, rows));
    for (int64_t i = 0; i < chunks; ++i) {
      const int64_t lo = rows * i / chunks, hi = rows * (i + 1) / chunks;
      at::Tensor block = grad_input.narrow(0, lo, hi - lo);
      trace_event("gemm_begin", i);
      at::mm_out(block, grad_out.narrow(0, lo, hi - lo), w);
      trace_event("gemm_end", i);
      std::vector<at::Tensor> bufs{block};
      trace_event("comm_start", i);
      reduce_works.push_back(issued(pg->allreduce(bufs), i));
    }
  } else if (sequence_parallel && need_weight_grad && !gathered) {
    total = at::empty({rows, input.size(1)}, input.options());
    trace_event("comm_start", 0);
    trace_collective("coll:all_gather", total);
    gather_work = pg->_allgather_base(total, const_cast<at::Tensor&>(input));
    wait(gather_work, 0);
  }
  if (need_weight_grad) {
    const int64_t index = sequence_parallel ? 1 : chunks;
    trace_event("gemm_begin", index);
    grad_weight = at::mm(grad_out.t(), total);  // (N/tp, K), while the reductions run
    trace_event("gemm_end", index);
  }
  const int64_t first = sequence_parallel ? 1 : 0;
  for (size_t i = 0; i < reduce_works.size(); ++i) wait(reduce_works[i], first + i);
  auto empty = at::empty({0}, input.options());
  return {need_input_grad ? grad_input : empty, need_weight_grad ? grad_weight : empty};
}

}  // namespace fastpar
