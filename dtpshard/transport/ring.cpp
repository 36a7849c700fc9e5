// The shared-memory ring's hot path in C++ (transport/native.py builds it; transport/shared.py
// defines the ring, its words and every rule this file follows).
//
// Why native: a decode step makes two ring ops per sum. Through the dispatcher into Python they
// cost 73-95 µs a sum in vLLM's compiled engine; these cost 7-10 µs (bench/profile_vllm.py,
// docs/benchmarks.md), less than TP's all-reduce of the same partial. Everything rare
// stays in Python, called back through the dispatcher: a message larger than a slot (the group's
// all-reduce), a wait that outlasts the spin (the peer checks, RankFailure, the timeout), and the
// ring being too small. So the rules of the ring are written once, in transport/shared.py.
//
// Memory order: the partial's bytes, then the sequence number with a release store; a reader
// acquires the number before reading the bytes.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/sum.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <sched.h>
#include <string>
#include <time.h>
#include <unordered_map>

namespace {

// transport/shared.py's layout: WORDS int64 per (slot, rank), then RANK_WORDS per rank
constexpr int64_t WORDS = 4, PUBLISHED = 0, READ = 1, AT = 2;
constexpr int64_t RANK_WORDS = 4, ISSUED = 2, LATENCY_NS = 3;
constexpr int64_t SPIN_NS = 5'000'000;  // then Python's wait: it sleeps and checks on the peer

struct Ring {
  int64_t* words;
  uint8_t* data;
  int64_t rank, world, slots, capacity;
  std::string key;
  int64_t word(int64_t slot, int64_t r) const { return (slot * world + r) * WORDS; }
  int64_t rank_word(int64_t r) const { return slots * world * WORDS + RANK_WORDS * r; }
  int64_t load(int64_t i) const { return __atomic_load_n(words + i, __ATOMIC_ACQUIRE); }
  void store(int64_t i, int64_t v) { __atomic_store_n(words + i, v, __ATOMIC_RELEASE); }
};

std::mutex rings_lock;
std::unordered_map<std::string, Ring> rings;

Ring& ring(c10::string_view key) {
  std::lock_guard<std::mutex> g(rings_lock);
  auto it = rings.find(std::string(key));
  TORCH_CHECK(it != rings.end(), "no exchange ring registered as ", key);
  return it->second;
}

int64_t now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);  // time.monotonic_ns(): the clock the peers stamp AT with
  return int64_t(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

c10::Stack python(const char* op, c10::Stack stack) {
  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(op, "");
  handle.callBoxed(stack);
  return stack;
}

// Until word i reaches target: spin (each pass yields the core), then Python's wait.
void wait(Ring& r, int64_t i, int64_t target, int64_t peer, const char* what) {
  if (r.load(i) >= target) return;
  RECORD_FUNCTION("dtpshard::ring_wait", std::vector<c10::IValue>());  // the profile's wait (bench/profile_vllm.py)
  if (peer != r.rank) {
    int64_t until = now_ns() + SPIN_NS;
    for (int n = 0;; ++n) {
      for (int k = 0; k < 64; ++k) {
        if (r.load(i) >= target) return;
        __builtin_ia32_pause();
      }
      sched_yield();
      if ((n & 15) == 15 && now_ns() > until) break;
    }
  }
  python("dtpshard::exchange_wait_py", {r.key, i, target, peer, std::string(what)});
}

// Sleep until the monotonic clock reads ns (the emulated link; as time.sleep does it).
void until(int64_t ns) {
  int64_t left = ns - now_ns();
  if (left <= 0) return;
  timespec t{time_t(left / 1'000'000'000), long(left % 1'000'000'000)};
  nanosleep(&t, nullptr);
}

// Σ of the slot's rows in rank order, as p's shape, the same bits as transport/shared.py's
// rows.sum(0). Two rows are added here: one rounding of a + b in torch's accumulation type, which
// is what torch's sum does, at a twentieth of its cost for a decode step's partial (its reduction
// set-up is most of ~8 µs). More rows take torch's sum of the same view.
at::Tensor sum_rows(const Ring& r, int64_t slot, const at::Tensor& p) {
  int64_t n = p.numel(), stride = r.capacity / int64_t(p.element_size());
  uint8_t* first = r.data + slot * r.world * r.capacity;
  auto options = at::TensorOptions().dtype(p.scalar_type());
  if (r.world == 2 && (p.is_floating_point())) {
    at::Tensor total = at::empty(p.sizes(), options);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.scalar_type(), "exchange_sum", [&] {
      using acc = at::opmath_type<scalar_t>;
      auto* a = reinterpret_cast<const scalar_t*>(first);
      auto* b = a + stride;
      auto* out = total.data_ptr<scalar_t>();
      for (int64_t i = 0; i < n; ++i) out[i] = scalar_t(acc(a[i]) + acc(b[i]));
    });
    return total;
  }
  at::Tensor rows = at::from_blob(first, {r.world, n}, {stride, 1}, options);
  return rows.sum(0).view(p.sizes());
}

at::Tensor start(const at::Tensor& p, c10::string_view key) {
  Ring& r = ring(key);
  int64_t nbytes = p.numel() * int64_t(p.element_size());
  if (nbytes > r.capacity || !p.device().is_cpu())
    return python("dtpshard::exchange_start_py", {p, std::string(key)})[0].toTensor();
  at::Tensor c = p.contiguous();
  int64_t* issued = r.words + r.rank_word(r.rank) + ISSUED;  // this rank's own: no peer reads it
  int64_t seq = ++*issued;
  int64_t slot = seq % r.slots;
  if (seq > r.slots)  // the slot's previous sum must be read by every rank first
    for (int64_t q = 0; q < r.world; ++q) wait(r, r.word(slot, q) + READ, seq - r.slots, q, "read");
  std::memcpy(r.data + (slot * r.world + r.rank) * r.capacity, c.data_ptr(), nbytes);
  int64_t w = r.word(slot, r.rank);
  r.store(w + AT, now_ns());
  r.store(w + PUBLISHED, seq);  // last: a peer that sees it sees the bytes
  at::Tensor token = at::empty({1}, at::TensorOptions().dtype(at::kLong));
  token.data_ptr<int64_t>()[0] = seq;
  return token;
}

at::Tensor value(const at::Tensor& token, const at::Tensor& p, c10::string_view key) {
  Ring& r = ring(key);
  int64_t seq = token.data_ptr<int64_t>()[0];
  int64_t slot = seq % r.slots;
  if (r.load(r.word(slot, r.rank) + PUBLISHED) != seq)  // not in the ring: a message larger than a slot
    return python("dtpshard::exchange_value_py", {token, p, std::string(key)})[0].toTensor();
  int64_t latency = r.load(r.rank_word(r.rank) + LATENCY_NS);
  for (int64_t q = 0; q < r.world; ++q) {
    if (q == r.rank) continue;
    int64_t w = r.word(slot, q);
    wait(r, w + PUBLISHED, seq, q, "sent");
    if (latency) until(r.load(w + AT) + latency);
  }
  at::Tensor total = sum_rows(r, slot, p);
  r.store(r.word(slot, r.rank) + READ, seq);
  return total;
}

void attach(c10::string_view key, int64_t base, int64_t header, int64_t rank, int64_t world, int64_t slots,
            int64_t capacity) {
  std::lock_guard<std::mutex> g(rings_lock);
  auto* b = reinterpret_cast<uint8_t*>(base);
  rings[std::string(key)] = Ring{reinterpret_cast<int64_t*>(b), b + header, rank, world, slots, capacity,
                                 std::string(key)};
}

void detach(c10::string_view key, int64_t base) {  // only the ring mapped at base: a newer one may hold key
  std::lock_guard<std::mutex> g(rings_lock);
  auto it = rings.find(std::string(key));
  if (it != rings.end() && it->second.words == reinterpret_cast<int64_t*>(base)) rings.erase(it);
}

}  // namespace

TORCH_LIBRARY_IMPL(dtpshard, CompositeExplicitAutograd, m) {
  m.impl("exchange_start", start);
  m.impl("exchange_value", value);
}

// No tensor to dispatch on: defined here with their one kernel (transport/native.py calls them).
TORCH_LIBRARY_FRAGMENT(dtpshard, m) {
  m.def("exchange_attach(str key, int base, int header, int rank, int world, int slots, int capacity) -> ()",
        attach);
  m.def("exchange_detach(str key, int base) -> ()", detach);
}
