// Every decoder layer of a CPU decode step in one call, a tensor-parallel rank's collectives included. With TP 9 x
// DCP 3 on two cores, a rank's step was ~25 torch ops and 3 shared-memory collectives per layer, each a trip through
// Python and the dispatcher that cost far more than its arithmetic; a single rank pays the same trips, fewer. This runs the same ops in the same order (pdserve/model/
// llama.py, DecoderLayer.forward_fused; pdserve/engine/comm.py, ShmComm), so its results are the same bits.
//
// The barrier is pdserve/engine/shm.py's Barrier over the same shared words: glibc's process-shared semaphores and a
// futex word, a waiter sleeping in slices and checking, between them, the abort word and its peers' processes.
// Built and loaded by pdserve/kernels/__init__.py.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <linux/futex.h>
#include <semaphore.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "ops.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kLine = 64;  // shm.py's LINE: every shared word on a cache line of its own
constexpr double kSliceS = 0.25;  // shm.py's Barrier.SLICE_S

int64_t words(int64_t n) { return (n * 8 + kLine - 1) / kLine * kLine; }

// A failure that breaks the group for good; the Python side turns it into RankFailure (pdserve/kernels/__init__.py).
[[noreturn]] void rank_failure(int64_t rank, const std::string& message) {
  TORCH_CHECK(false, "RankFailure[", rank, "]: ", message);
}

char proc_state(int64_t pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "rb");
  if (!f) return 0;
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* close = std::strrchr(buf, ')');  // the command name in parentheses may itself hold ")"
  return close && close[1] && close[2] ? close[2] : 0;
}

// One ShmComm group as its Python side describes it (ShmComm.native()): [barrier address, n, rank, slots address,
// slot bytes, spin, seq, timeout ms, stall ms, the members' TP ranks...].
struct Group {
  uint32_t* gen;
  uint32_t* abort;
  sem_t* sems[2];
  sem_t* sleepers;
  int64_t* pids;
  int64_t* arrived;
  int64_t n, rank, spin, seq, timeout_ms, stall_ms;
  uint8_t* data;
  int64_t slot_bytes;
  std::vector<int64_t> tp_ranks;
  std::unordered_map<int64_t, Clock::time_point> stopped_since;

  explicit Group(at::IntArrayRef d) {
    TORCH_CHECK(d.size() >= 9 && static_cast<int64_t>(d.size()) == 9 + d[1], "decode_layers: a bad group handle");
    auto* base = reinterpret_cast<uint8_t*>(d[0]);
    n = d[1], rank = d[2], spin = d[5], seq = d[6], timeout_ms = d[7], stall_ms = d[8];
    data = reinterpret_cast<uint8_t*>(d[3]);
    slot_bytes = d[4];
    gen = reinterpret_cast<uint32_t*>(base);
    abort = reinterpret_cast<uint32_t*>(base + kLine);
    sems[0] = reinterpret_cast<sem_t*>(base + 2 * kLine);
    sems[1] = reinterpret_cast<sem_t*>(base + 3 * kLine);
    sleepers = reinterpret_cast<sem_t*>(base + 4 * kLine);
    pids = reinterpret_cast<int64_t*>(base + 6 * kLine);
    arrived = reinterpret_cast<int64_t*>(base + 6 * kLine + words(n));
    tp_ranks.assign(d.begin() + 9, d.end());
  }

  // Rank r's slot for the next wait's phase (the slot sets alternate by phase), and for the last wait's.
  uint8_t* slot(int64_t r) const { return data + (((seq + 1) & 1) * n + r) * slot_bytes; }
  uint8_t* slot_of_last(int64_t r) const { return data + ((seq & 1) * n + r) * slot_bytes; }

  bool complete(sem_t* sem) const {
    int v = 0;
    sem_getvalue(sem, &v);
    if (v < n) return false;
    for (int64_t i = 0; i < n; ++i)
      if (__atomic_load_n(arrived + i, __ATOMIC_SEQ_CST) < seq) return false;
    return true;
  }

  void release(uint32_t s) {
    __atomic_store_n(gen, s, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);  // the store above before the load below (a sleeper mirrors it)
    int v = 0;
    sem_getvalue(sleepers, &v);
    if (v) syscall(SYS_futex, gen, FUTEX_WAKE, 0x7FFFFFFF, nullptr, nullptr, 0);
  }

  void check_peers(const char* what) {
    const auto now = Clock::now();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pid = pids[i];
      if (i == rank || pid == 0) continue;
      const char st = proc_state(pid);
      if (st == 0 || st == 'Z' || st == 'X')
        rank_failure(tp_ranks[i], "TP rank " + std::to_string(tp_ranks[i]) + " (pid " + std::to_string(pid) +
                                      ") exited during " + what);
      if (st == 'T' || st == 't') {
        const auto since = stopped_since.try_emplace(pid, now).first->second;
        const double s = std::chrono::duration<double>(now - since).count();
        if (s * 1000 > stall_ms) {
          char secs[32];
          std::snprintf(secs, sizeof secs, "%.1f", s);  // shm.py's message, to the same digit
          rank_failure(tp_ranks[i], "TP rank " + std::to_string(tp_ranks[i]) + " (pid " + std::to_string(pid) +
                                        ") has been stopped for " + secs + " s during " + what);
        }
      } else {
        stopped_since.erase(pid);
      }
    }
  }

  void wait(const char* what) {
    ++seq;
    const uint32_t s = static_cast<uint32_t>(seq);
    sem_t* sem = sems[seq & 1];
    __atomic_store_n(arrived + rank, seq, __ATOMIC_SEQ_CST);
    sem_post(sem);
    if (complete(sem)) {
      release(s);
    } else if (__atomic_load_n(gen, __ATOMIC_SEQ_CST) != s) {
      sleep_until(s, sem, what);
    }
    sem_trywait(sem);
  }

  void sleep_until(uint32_t s, sem_t* sem, const char* what) {
    for (int64_t i = 0; i < spin; ++i)
      if (__atomic_load_n(gen, __ATOMIC_SEQ_CST) == s) return;
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    const timespec slice{0, static_cast<long>(kSliceS * 1e9)};
    while (true) {
      sem_post(sleepers);
      const uint32_t cur = __atomic_load_n(gen, __ATOMIC_SEQ_CST);
      if (cur != s) syscall(SYS_futex, gen, FUTEX_WAIT, cur, &slice, nullptr, 0);
      sem_trywait(sleepers);
      if (__atomic_load_n(gen, __ATOMIC_SEQ_CST) == s) return;
      if (complete(sem)) {  // the last arrival read a stale arrival word: release now
        release(s);
        return;
      }
      if (__atomic_load_n(abort, __ATOMIC_SEQ_CST))
        rank_failure(-1, std::string(what) + " was aborted: the pod is stopping its ranks");
      check_peers(what);
      if (Clock::now() > deadline) {
        std::string late;
        int64_t first = -1;
        for (int64_t i = 0; i < n; ++i) {
          if (arrived[i] >= seq) continue;
          late += (late.empty() ? "" : ", ") + std::to_string(tp_ranks[i]);
          if (first < 0) first = tp_ranks[i];
        }
        rank_failure(first, std::string(what) + " timed out after " + std::to_string(timeout_ms / 1000) +
                                " s waiting for TP rank(s) [" + late + "]");
      }
    }
  }

  // [n, numel] views of every rank's slot for the next phase, as dtype.
  at::Tensor slots(at::ScalarType dtype, int64_t numel) const {
    const int64_t item = c10::elementSize(dtype);
    TORCH_CHECK(numel * item <= slot_bytes, "decode_layers: a collective larger than a slot");
    return at::from_blob(slot(0), {n, numel}, {slot_bytes / item, 1}, at::TensorOptions().dtype(dtype));
  }

  // ShmComm.all_reduce: every rank's x in its slot, one barrier, the slots summed in rank order.
  at::Tensor all_reduce(const at::Tensor& x) {
    auto rows = slots(x.scalar_type(), x.numel());
    auto src = x.contiguous();
    std::memcpy(slot(rank), src.data_ptr(), src.nbytes());  // a torch copy_ costs more than this copy
    wait("an all-reduce");
    auto out = at::empty_like(x);
    auto flat = out.view(-1);
    pdserve_kernels::sum_in_order(rows, flat);
    return out;
  }
};

// plinear.linear on a packed weight of x's dtype: oneDNN's matmul on the prepacked weight.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  c10::List<std::optional<at::Scalar>> scalars;
  scalars.push_back(std::nullopt);
  std::vector<c10::IValue> stack{x, packed, bias, std::string("none"), scalars, std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// write_kv: each new row's K and V into its slot; slot -1 rows belong to another DCP rank.
void write_kv(const at::Tensor& kv_layer, const at::Tensor& qkv, const int64_t* slots, int64_t t, int64_t k_off,
              int64_t kv_size) {
  const int64_t item = kv_layer.element_size(), row_stride = qkv.stride(0) * item;
  auto* k_dst = static_cast<uint8_t*>(kv_layer[0].data_ptr());
  auto* v_dst = static_cast<uint8_t*>(kv_layer[1].data_ptr());
  const auto* src = static_cast<const uint8_t*>(qkv.data_ptr());
  const int64_t bytes = kv_size * item;
  for (int64_t r = 0; r < t; ++r) {
    if (slots[r] < 0) continue;
    std::memcpy(k_dst + slots[r] * bytes, src + r * row_stride + k_off * item, bytes);
    std::memcpy(v_dst + slots[r] * bytes, src + r * row_stride + (k_off + kv_size) * item, bytes);
  }
}

// ParallelState.dcp_gather_heads: this rank's query heads [t, h, d] -> the group's [t, n * h, d], group-rank order.
at::Tensor dcp_gather_heads(Group& dcp, const at::Tensor& q) {
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d, "dcp_gather_heads: each row's heads contiguous");
  const int64_t row = h * d * q.element_size(), stride = q.stride(0) * q.element_size();
  dcp.slots(q.scalar_type(), t * h * d);  // checks the size
  const auto* src = static_cast<const uint8_t*>(q.data_ptr());
  uint8_t* mine = dcp.slot(dcp.rank);
  for (int64_t i = 0; i < t; ++i) std::memcpy(mine + i * row, src + i * stride, row);
  dcp.wait("an all-gather");
  auto out = at::empty({t, dcp.n * h, d}, q.options());
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  for (int64_t i = 0; i < t; ++i)
    for (int64_t r = 0; r < dcp.n; ++r) std::memcpy(dst + (i * dcp.n + r) * row, dcp.slot_of_last(r) + i * row, row);
  return out;
}

// ParallelState.dcp_merge: the group's partial (out, LSE) through the DCP slots as fp32, then this rank's heads merged.
at::Tensor dcp_merge(Group& dcp, const at::Tensor& out, const at::Tensor& lse) {
  const int64_t t = out.size(0), h = out.size(1), d = out.size(2), thd = t * h * d;
  auto parts = dcp.slots(at::kFloat, thd + t * h);
  auto mine = parts[dcp.rank];
  if (out.scalar_type() == at::kFloat && out.is_contiguous()) {  // plain copies: torch's copy_ costs more
    std::memcpy(mine.data_ptr(), out.data_ptr(), thd * sizeof(float));
  } else {
    mine.narrow(0, 0, thd).copy_(out.reshape(-1));
  }
  auto l = lse.contiguous();
  std::memcpy(static_cast<float*>(mine.data_ptr()) + thd, l.data_ptr(), t * h * sizeof(float));
  dcp.wait("an all-gather");
  const int64_t first = dcp.rank * h / dcp.n, last = (dcp.rank + 1) * h / dcp.n;
  auto outs = parts.narrow(1, 0, thd).view({dcp.n, t, h, d}).narrow(2, first, last - first);
  auto lses = parts.narrow(1, thd, t * h).view({dcp.n, t, h}).narrow(2, first, last - first);
  return std::get<0>(pdserve_kernels::merge_partials(outs, lses)).to(out.scalar_type());
}

// plinear.rank_linear's rule: an int8 weight (`packed` then holds its scales) through the W8A8 kernels as
// plinear.int8_linear calls them; one step row (batch 1) on a TP shard through gemv.cpp, faster than oneDNN on a
// shard; else the packed weight.
at::Tensor rank_linear(const at::Tensor& x, const at::Tensor& plain, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias, bool shard, int64_t group) {
  if (plain.scalar_type() == at::kChar)
    return packed.dim() == plain.dim() ? pdserve_kernels::int8_linear_grouped(x, plain, packed, group, bias)
                                       : pdserve_kernels::int8_linear(x, plain, packed, bias);
  return shard && x.size(0) == 1 ? pdserve_kernels::gemv(x, plain, bias) : packed_linear(x, packed, bias);
}

// The arguments decode_layers and prefill_layers share: 10 weights and 4 biases per layer, a contiguous stream.
void check_layers(const char* who, const at::Tensor& x, const at::Tensor& slot_mapping, at::TensorList weights,
                  const c10::List<std::optional<at::Tensor>>& biases, int64_t layers) {
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 10 * layers && static_cast<int64_t>(biases.size()) == 4 * layers,
              who, ": 10 weights and 4 biases per layer");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && slot_mapping.scalar_type() == at::kLong, who, ": inputs");
}

// One layer's weights and sizes, and the two halves of DecoderLayer.forward_fused around its attention, which a
// decode step and a prefill compute alike. shard: a TP rank's (its one-row linears go through gemv); group: the
// int8 weights' block of input columns.
struct Layer {
  const at::Tensor* w;  // the layer's 10 weights (decode_layers' order)
  const c10::List<std::optional<at::Tensor>>& biases;
  int64_t index, hd, q_size, kv_size;
  double eps;
  bool shard;
  int64_t group;

  std::optional<at::Tensor> bias(int64_t j) const { return biases.get(4 * index + j); }

  // x += delta, the input norm, qkv, rope in place, the new rows' K/V into the cache. Returns the qkv rows.
  at::Tensor attention_input(at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& cos,
                             const at::Tensor& sin, const at::Tensor& kv_layer, const int64_t* slots) const {
    auto h = std::get<1>(pdserve_kernels::add_rms_norm(x, delta, w[0], eps));
    auto qkv = rank_linear(h, w[6], w[1], bias(0), shard, group);
    pdserve_kernels::rope_(qkv, cos, sin, (q_size + kv_size) / hd, hd);
    write_kv(kv_layer, qkv, slots, x.size(0), q_size, kv_size);
    return qkv;
  }

  // o_proj of the attention rows `out` (reduced, + bias), x += it, the post-attention norm and the MLP (its down
  // projection reduced, + bias). reduce: the TP all-reduce, or nothing on one rank. Returns the MLP's output.
  template <typename Reduce>
  at::Tensor attention_output_and_mlp(at::Tensor& x, const at::Tensor& out, Reduce reduce) const {
    auto attn = reduce(rank_linear(out.reshape({out.size(0), q_size}), w[7], w[2], std::nullopt, shard, group));
    if (auto b = bias(1)) attn = attn + *b;
    auto h = std::get<1>(pdserve_kernels::add_rms_norm(x, attn, w[3], eps));
    auto act = pdserve_kernels::silu_mul(rank_linear(h, w[8], w[4], bias(2), shard, group));
    auto mlp = reduce(rank_linear(act, w[9], w[5], std::nullopt, shard, group));
    if (auto b = bias(3)) mlp = mlp + *b;
    return mlp;
  }
};

// weights: per layer [input norm, qkv packed, o packed, post-attention norm, gate_up packed, down packed, then the
// four linears' weights as stored: qkv, o, gate_up, down] (an int8 weight's "packed" is its float32 scales);
// biases: per layer [qkv, o, gate_up, down]; dims: [layers, head_dim, q_size, kv_size, window, dcp_size, group];
// floats: [eps, scale]. Returns (the residual stream, the last MLP's output, the TP and DCP groups' barrier counts).
std::tuple<at::Tensor, at::Tensor, int64_t, int64_t> decode_layers(
    at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& context_lens,
    at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef dims,
    at::ArrayRef<double> floats, at::IntArrayRef tp_comm, at::IntArrayRef dcp_comm) {
  TORCH_CHECK(dims.size() == 7 && floats.size() == 2, "decode_layers: dims / floats");
  const int64_t layers = dims[0], hd = dims[1], q_size = dims[2], kv_size = dims[3], window = dims[4];
  const int64_t dcp_size = dims[5], group = dims[6];
  const double eps = floats[0], scale = floats[1];
  check_layers("decode_layers", x, slot_mapping, weights, biases, layers);
  std::optional<Group> tp;  // none: a single rank, whose step has no collectives
  if (!tp_comm.empty()) tp.emplace(tp_comm);
  const bool shard = tp.has_value();
  auto all_reduce = [&](const at::Tensor& y) { return tp ? tp->all_reduce(y) : y; };
  std::optional<Group> dcp;
  if (dcp_size > 1) dcp.emplace(dcp_comm);
  const int64_t t = x.size(0);
  auto slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  std::optional<at::Tensor> delta;
  for (int64_t i = 0; i < layers; ++i) {
    const Layer layer{weights.data() + 10 * i, biases, i, hd, q_size, kv_size, eps, shard, group};
    auto kv_layer = kv_cache[i];
    auto qkv = layer.attention_input(x, delta, cos, sin, kv_layer, sp);
    auto q = qkv.narrow(1, 0, q_size).view({t, q_size / hd, hd});
    if (dcp) q = dcp_gather_heads(*dcp, q);
    auto [out, lse] = pdserve_kernels::paged_decode_attention(q, kv_layer[0], kv_layer[1], block_tables, context_lens,
                                                              window, scale);
    if (dcp) out = dcp_merge(*dcp, out, lse);
    delta = layer.attention_output_and_mlp(x, out, all_reduce);
  }
  return {x, *delta, tp ? tp->seq : 0, dcp ? dcp->seq : 0};
}

// Every decoder layer of a single rank's prefill of whole prompts (each sequence's keys are exactly its new rows) in
// one call: DecoderLayer.forward_fused op for op, so the same bits. cu_seqlens: the sequences' row offsets; rows:
// past the last layer's attention only these rows go on (CausalLM.forward's logits rows), none: every row.
// weights, biases, floats as decode_layers'; dims: [layers, head_dim, q_size, kv_size, group]. Returns (stream, last
// MLP out).
std::tuple<at::Tensor, at::Tensor> prefill_layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                                  const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                                                  at::IntArrayRef cu_seqlens, at::TensorList weights,
                                                  const c10::List<std::optional<at::Tensor>>& biases,
                                                  at::IntArrayRef dims, at::ArrayRef<double> floats,
                                                  const std::optional<at::Tensor>& rows) {
  TORCH_CHECK(dims.size() == 5 && floats.size() == 2, "prefill_layers: dims / floats");
  const int64_t layers = dims[0], hd = dims[1], q_size = dims[2], kv_size = dims[3], group = dims[4];
  const double eps = floats[0], scale = floats[1];
  check_layers("prefill_layers", x, slot_mapping, weights, biases, layers);
  const int64_t t = x.size(0), nseq = static_cast<int64_t>(cu_seqlens.size()) - 1;
  TORCH_CHECK(nseq >= 1 && cu_seqlens[0] == 0 && cu_seqlens[nseq] == t, "prefill_layers: cu_seqlens");
  auto slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  std::optional<at::Tensor> delta;
  for (int64_t i = 0; i < layers; ++i) {
    const Layer layer{weights.data() + 10 * i, biases, i, hd, q_size, kv_size, eps, /*shard=*/false, group};
    auto qkv = layer.attention_input(x, delta, cos, sin, kv_cache[i], sp);
    auto q = qkv.narrow(1, 0, q_size).view({t, q_size / hd, hd});
    auto k = qkv.narrow(1, q_size, kv_size).view({t, kv_size / hd, hd});
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, kv_size / hd, hd});
    at::Tensor out;
    if (nseq == 1) {
      out = std::get<0>(pdserve_kernels::prefill_attention(q, k, v, scale));
    } else {
      std::vector<at::Tensor> outs;
      for (int64_t s = 0; s < nseq; ++s) {
        const int64_t a = cu_seqlens[s], n = cu_seqlens[s + 1] - a;
        outs.push_back(std::get<0>(
            pdserve_kernels::prefill_attention(q.narrow(0, a, n), k.narrow(0, a, n), v.narrow(0, a, n), scale)));
      }
      out = at::cat(outs);
    }
    if (i == layers - 1 && rows) {  // only the logits rows go on (none: a chunk before a prompt's last)
      out = out.index_select(0, *rows);
      x = x.index_select(0, *rows);
    }
    delta = layer.attention_output_and_mlp(x, out, [](const at::Tensor& y) { return y; });
  }
  return {x, *delta};
}

// One wait of a group's barrier (ShmComm.native / Barrier.native handle): the protocol shared with shm.py's
// Barrier, checked against it by the tests. Returns the group's barrier count after the wait.
int64_t barrier_wait(at::IntArrayRef group, c10::string_view what) {
  Group g(group);
  g.wait(std::string(what).c_str());
  return g.seq;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("barrier_wait(int[] group, str what) -> int", TORCH_FN(barrier_wait));
  m.def(
      "decode_layers(Tensor(a!) x, Tensor cos, Tensor sin, Tensor(b!) kv_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor context_lens, Tensor[] weights, Tensor?[] biases, int[] dims, float[] floats, "
      "int[] tp_comm, int[] dcp_comm) -> (Tensor, Tensor, int, int)",
      TORCH_FN(decode_layers));  // one kernel for every key: the packed weights are MkldnnCPU tensors
  m.def(
      "prefill_layers(Tensor(a!) x, Tensor cos, Tensor sin, Tensor(b!) kv_cache, Tensor slot_mapping, "
      "int[] cu_seqlens, Tensor[] weights, Tensor?[] biases, int[] dims, float[] floats, Tensor? rows) "
      "-> (Tensor, Tensor)",
      TORCH_FN(prefill_layers));
}
