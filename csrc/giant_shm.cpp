// Shared-memory collectives for the "giant" torch.distributed backend.
//
// A C ABI (loaded with ctypes, fed tensor.data_ptr()) so the library builds
// without torch or pybind11. One handle serves one process group's ranks on
// one host. Layout of the segment:
//
//   [header: magic, pids, abort flag, one 64-byte flag per rank, schedule ring]
//   [rank 0: buffer 0 | buffer 1][rank 1: buffer 0 | buffer 1] ...
//   [rank 0: sizes 0 | sizes 1][rank 1: sizes 0 | sizes 1] ...  (uneven all-to-all)
//
// Every collective is cut into chunks that fit in a rank's buffer. Chunks
// alternate between the two buffers, so a rank fills buffer b for chunk g
// while slower peers still read buffer b^1 of chunk g-1. Ranks meet at
// "phases": each rank bumps its own flag and waits for every peer's flag to
// reach the same value. Reaching phase p proves each peer finished all work
// before p, which is what makes reusing buffer b at chunk g+2 safe. Waits spin
// briefly, then sleep on a futex, and give up on a timeout, an abort raised by
// any rank, or a peer process that has died.

#include <atomic>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

namespace {

enum Dtype { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3, kI32 = 4, kI64 = 5 };
enum Op { kOpSum = 0, kOpAvg = 1, kOpMax = 2, kOpMin = 3 };
enum Status { kOk = 0, kTimeout = 1, kPeerDied = 2, kBadArg = 3, kAborted = 4, kUnsupported = 5 };

// fp16 arithmetic needs _Float16 (GCC >= 12 on x86-64). Without it the core
// reports fp16 as unsupported (gm_supports) and the backend delegates fp16
// collectives. -DGIANT_HAVE_FLOAT16=0 forces that path, for its tests.
#ifndef GIANT_HAVE_FLOAT16
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && (__GNUC__ >= 12)
#define GIANT_HAVE_FLOAT16 1
#else
#define GIANT_HAVE_FLOAT16 0
#endif
#endif

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,f16c,fma")
namespace isa_avx2 {
#include "giant_kernels.inc"
}  // namespace isa_avx2
#pragma GCC pop_options
#endif
namespace isa_base {
#include "giant_kernels.inc"
}  // namespace isa_base

using ReduceFn = int (*)(void*, void*, const void* const*, int, int64_t, int, int, double);
using TriadFn = void (*)(double*, const double*, const double*, double, int64_t);

struct Kernels {
  ReduceFn reduce;
  TriadFn triad;
  const char* isa;
};

Kernels pick_kernels() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
      __builtin_cpu_supports("fma")) {
    return {isa_avx2::reduce, isa_avx2::triad, "avx2"};
  }
#endif
  return {isa_base::reduce, isa_base::triad, "base"};
}

const Kernels& kernels() {
  static const Kernels k = pick_kernels();
  return k;
}

constexpr uint32_t kMagic = 0x6a616e74;  // "jant"
constexpr int kMaxRanks = 128;
constexpr int kSchedRing = 1024;

struct alignas(64) Flag {
  std::atomic<uint32_t> value;
  std::atomic<uint32_t> sleepers;
  char pad[56];
};

struct Header {
  std::atomic<uint32_t> magic;
  int32_t world;
  int64_t slot_bytes;
  std::atomic<int32_t> abort;
  int32_t pad0;
  std::atomic<int32_t> pids[kMaxRanks];
  Flag flags[kMaxRanks];
  Flag sched_count;
  Flag sched_ack[kMaxRanks];
  std::atomic<int64_t> sched[kSchedRing];
};

constexpr size_t header_bytes() { return (sizeof(Header) + 4095) / 4096 * 4096; }

long futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* ts) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// Workers that split one copy or reduce across threads of this process.
class Pool {
 public:
  explicit Pool(int n) : n_(std::max(1, n)) {
    for (int i = 1; i < n_; ++i) workers_.emplace_back([this, i] { loop(i); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> g(m_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return n_; }
  // Runs fn(begin, end) over [0, n) cut into aligned pieces, one per thread.
  void run(int64_t n, int64_t align, const std::function<void(int64_t, int64_t)>& fn) {
    if (n_ == 1 || n < 65536) {
      fn(0, n);
      return;
    }
    int64_t per = (n + n_ - 1) / n_;
    per = (per + align - 1) / align * align;
    {
      std::lock_guard<std::mutex> g(m_);
      job_ = [&](int i) {
        int64_t b = std::min<int64_t>(n, per * i), e = std::min<int64_t>(n, b + per);
        if (b < e) fn(b, e);
      };
      pending_ = n_ - 1;
      ++gen_;
    }
    cv_.notify_all();
    job_(0);
    std::unique_lock<std::mutex> lk(m_);
    done_.wait(lk, [this] { return pending_ == 0; });
  }

 private:
  void loop(int i) {
    uint64_t seen = 0;
    for (;;) {
      std::function<void(int)> job;
      {
        std::unique_lock<std::mutex> lk(m_);
        cv_.wait(lk, [&] { return stop_ || gen_ != seen; });
        if (stop_) return;
        seen = gen_;
        job = job_;
      }
      job(i);
      std::lock_guard<std::mutex> g(m_);
      if (--pending_ == 0) done_.notify_one();
    }
  }
  int n_;
  std::vector<std::thread> workers_;
  std::mutex m_;
  std::condition_variable cv_, done_;
  std::function<void(int)> job_;
  uint64_t gen_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

struct Comm {
  Header* hdr = nullptr;
  char* data = nullptr;
  size_t map_bytes = 0;
  int rank = 0, world = 1;
  int64_t slot = 0;      // bytes in one of a rank's two buffers
  uint32_t phase = 0;    // phases this rank has entered
  uint64_t chunk = 0;    // chunks done, picks the buffer
  double timeout_s = 300.0;
  std::atomic<bool> cancel{false};  // this process is shutting the handle down
  int spin_pauses = 256;             // busy-wait rounds before yielding
  int spin_yields = 32;              // sched_yield rounds before sleeping
  Pool* pool = nullptr;
  std::string error;

  char* buf(int r, uint64_t g) const { return data + (static_cast<int64_t>(r) * 2 + (g & 1)) * slot; }
  // Each rank's split sizes for an uneven all-to-all, double-buffered like
  // buf(); kept apart from the data buffers so blocks that fill a buffer
  // exactly (a 1 MB all-to-all of 2 ranks) still move in one round.
  int64_t* sizes(int r, uint64_t g) const {
    return reinterpret_cast<int64_t*>(data + static_cast<int64_t>(world) * 2 * slot +
                                      (static_cast<int64_t>(r) * 2 + (g & 1)) * sizes_bytes(world));
  }
  static int64_t sizes_bytes(int w) { return (2 * w * 8 + 63) / 64 * 64; }
};

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

bool process_dead(int pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  // A killed child stays a zombie until reaped, and kill() still finds it.
  char path[64], stat[256];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  size_t got = std::fread(stat, 1, sizeof(stat) - 1, f);
  std::fclose(f);
  stat[got] = 0;
  const char* p = std::strrchr(stat, ')');
  return p != nullptr && (p[2] == 'Z' || p[2] == 'X');
}

int fail(Comm* c, int code, const std::string& msg) {
  c->error = msg;
  if (code == kTimeout || code == kPeerDied) c->hdr->abort.store(1, std::memory_order_release);
  return code;
}

// Waits until f >= target (modulo 2^32), checking health every ~2 ms; peer
// is the rank whose death would mean the flag never moves.
int wait_on(Comm* c, Flag& f, int peer, uint32_t target) {
  auto reached = [&] {
    return static_cast<int32_t>(f.value.load(std::memory_order_acquire) - target) >= 0;
  };
  // A peer already inside the collective arrives within microseconds: spin
  // briefly for it. Then yield, then sleep: on a host with more runnable
  // threads than cores (ranks plus their compute threads) spinning longer
  // would steal the very core the peer needs.
  for (int i = 0; i < c->spin_pauses; ++i) {
    if (reached()) return kOk;
    cpu_relax();
  }
  for (int i = 0; i < c->spin_yields; ++i) {
    if (reached()) return kOk;
    sched_yield();
  }
  const double deadline = now_s() + c->timeout_s;
  const timespec nap{0, 2000000};
  for (;;) {
    f.sleepers.fetch_add(1, std::memory_order_seq_cst);
    uint32_t seen = f.value.load(std::memory_order_seq_cst);
    if (static_cast<int32_t>(seen - target) < 0) futex(&f.value, FUTEX_WAIT, seen, &nap);
    f.sleepers.fetch_sub(1, std::memory_order_acq_rel);
    if (reached()) return kOk;
    if (c->cancel.load(std::memory_order_acquire))
      return fail(c, kAborted, "this process is shutting the group down");
    if (c->hdr->abort.load(std::memory_order_acquire))
      return fail(c, kAborted, "another rank aborted the shared-memory group");
    int pid = c->hdr->pids[peer].load(std::memory_order_acquire);
    if (process_dead(pid))
      return fail(c, kPeerDied, "local rank " + std::to_string(peer) + " (pid " +
                                   std::to_string(pid) + ") died during a collective");
    if (now_s() > deadline)
      return fail(c, kTimeout, "timed out after " + std::to_string(c->timeout_s) +
                                   " s waiting for local rank " + std::to_string(peer));
  }
}

int wait_flag(Comm* c, int peer, uint32_t target) {
  return wait_on(c, c->hdr->flags[peer], peer, target);
}

// Publishes "this rank reached the next phase" and waits for every peer.
int phase(Comm* c) {
  const uint32_t p = ++c->phase;
  Flag& mine = c->hdr->flags[c->rank];
  // seq_cst store then load: a waiter increments `sleepers` before its last
  // look at `value`; a weaker order lets both sides miss each other and the
  // waiter oversleeps its whole nap.
  mine.value.store(p, std::memory_order_seq_cst);
  if (mine.sleepers.load(std::memory_order_seq_cst) > 0) futex(&mine.value, FUTEX_WAKE, INT32_MAX, nullptr);
  for (int q = 0; q < c->world; ++q) {
    if (q == c->rank) continue;
    int rc = wait_flag(c, q, p);
    if (rc != kOk) return rc;
  }
  // Every peer reached p, but one that timed out waiting for this rank had
  // reached p too before it gave up: the collective failed there, so it
  // fails here, rather than succeed on one rank and raise on another.
  if (c->hdr->abort.load(std::memory_order_acquire))
    return fail(c, kAborted, "another rank aborted the shared-memory group");
  return kOk;
}

int elem_size(int dtype) {
  switch (dtype) {
    case kF32: case kI32: return 4;
    case kF64: case kI64: return 8;
    case kF16: case kBF16: return 2;
  }
  return 0;
}

void pcopy(Comm* c, void* dst, const void* src, int64_t bytes) {
  if (bytes <= 0 || dst == src) return;
  c->pool->run(bytes, 64, [&](int64_t b, int64_t e) {
    std::memcpy(static_cast<char*>(dst) + b, static_cast<const char*>(src) + b, e - b);
  });
}

int preduce(Comm* c, void* d1, void* d2, const void* const* srcs, int nsrc, int64_t n,
            int dtype, int op, double scale) {
  const int es = elem_size(dtype);
  std::atomic<int> rc{0};  // written by every pool thread that fails
  c->pool->run(n, 16, [&](int64_t b, int64_t e) {
    const void* local[kMaxRanks];
    for (int s = 0; s < nsrc; ++s) local[s] = static_cast<const char*>(srcs[s]) + b * es;
    void* o2 = d2 ? static_cast<char*>(d2) + b * es : nullptr;
    if (kernels().reduce(static_cast<char*>(d1) + b * es, o2, local, nsrc, e - b, dtype, op, scale) != 0)
      rc.store(-1, std::memory_order_relaxed);
  });
  return rc.load(std::memory_order_relaxed);  // Pool::run returns once every piece is done
}

// Element range [begin, end) of rank r's share of an m-element chunk. Shares
// are multiples of 16 elements so each starts on a 64-byte-friendly boundary.
void share(int64_t m, int world, int r, int64_t* begin, int64_t* end) {
  int64_t per = (m + world - 1) / world;
  per = (per + 15) / 16 * 16;
  *begin = std::min<int64_t>(m, per * r);
  *end = std::min<int64_t>(m, *begin + per);
}

int check_op(int dtype, int op) {
  if (elem_size(dtype) == 0) return kUnsupported;
  if (op < kOpSum || op > kOpMin) return kUnsupported;
  if (op == kOpAvg && (dtype == kI32 || dtype == kI64)) return kUnsupported;
#if !GIANT_HAVE_FLOAT16
  if (dtype == kF16) return kUnsupported;
#endif
  return kOk;
}

}  // namespace

extern "C" {

int gm_abi_version() { return 8; }

// 1 when gm_allreduce/gm_reduce_scatter handle this dtype and op here.
int gm_supports(int dtype, int op) { return check_op(dtype, op) == kOk ? 1 : 0; }

const char* gm_isa() { return kernels().isa; }

int gm_unlink(const char* name) { return shm_unlink(name) == 0 ? 0 : errno; }

// Creates (create=1, rank 0) or opens the segment. Returns nullptr on failure
// with a message in err.
void* gm_open(const char* name, int rank, int world, int64_t slot_bytes, int create,
              int threads, double timeout_s, char* err, int errlen) {
  auto bail = [&](const std::string& m) -> void* {
    std::snprintf(err, errlen, "%s", m.c_str());
    return nullptr;
  };
  if (world < 1 || world > kMaxRanks || rank < 0 || rank >= world)
    return bail("local group size must be in [1, 128]");
  if (slot_bytes < 4096 || slot_bytes % 4096 != 0)
    return bail("chunk bytes must be a positive multiple of 4096");
  const size_t total = header_bytes() + static_cast<size_t>(world) * 2 * slot_bytes +
                       static_cast<size_t>(world) * 2 * Comm::sizes_bytes(world);
  int fd = create ? shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600) : shm_open(name, O_RDWR, 0600);
  if (fd < 0) return bail(std::string("shm_open(") + name + "): " + std::strerror(errno));
  if (create && ftruncate(fd, static_cast<off_t>(total)) != 0) {
    std::string m = std::string("ftruncate: ") + std::strerror(errno) + " (is /dev/shm large enough?)";
    close(fd);
    shm_unlink(name);
    return bail(m);
  }
  void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    if (create) shm_unlink(name);
    return bail(std::string("mmap: ") + std::strerror(errno));
  }
  auto* c = new Comm();
  c->hdr = static_cast<Header*>(p);
  c->data = static_cast<char*>(p) + header_bytes();
  c->map_bytes = total;
  c->rank = rank;
  c->world = world;
  c->slot = slot_bytes;
  c->timeout_s = timeout_s;
  if (create) {
    c->hdr->world = world;
    c->hdr->slot_bytes = slot_bytes;
    c->hdr->magic.store(kMagic, std::memory_order_release);
  } else if (c->hdr->magic.load(std::memory_order_acquire) != kMagic ||
             c->hdr->world != world || c->hdr->slot_bytes != slot_bytes) {
    munmap(p, total);
    delete c;
    return bail("shared-memory segment has a different layout than this rank expects");
  }
  c->hdr->pids[rank].store(static_cast<int32_t>(getpid()), std::memory_order_release);
  c->pool = new Pool(threads);
  return c;
}

void gm_close(void* h) {
  auto* c = static_cast<Comm*>(h);
  if (c == nullptr) return;
  delete c->pool;
  munmap(c->hdr, c->map_bytes);
  delete c;
}

// Makes this process's pending and future waits on h return kAborted, so a
// thread blocked in one can exit before gm_close unmaps the segment.
void gm_cancel(void* h) { static_cast<Comm*>(h)->cancel.store(true, std::memory_order_release); }

void gm_abort(void* h) { static_cast<Comm*>(h)->hdr->abort.store(1, std::memory_order_release); }

const char* gm_error(void* h) { return static_cast<Comm*>(h)->error.c_str(); }

void gm_set_timeout(void* h, double s) { static_cast<Comm*>(h)->timeout_s = s; }

// With more ranks than cores a waiting rank should give its core to the
// rank it waits for at once rather than spin.
void gm_set_spin(void* h, int pauses, int yields) {
  auto* c = static_cast<Comm*>(h);
  c->spin_pauses = std::max(0, pauses);
  c->spin_yields = std::max(0, yields);
}

int gm_barrier(void* h) { return phase(static_cast<Comm*>(h)); }

// out = op over ranks of in; count elements; in may equal out. Per chunk:
// publish the shares other ranks reduce, reduce my share from my input and
// their buffers (into my buffer and my output), then copy theirs out.
int gm_allreduce(void* h, const void* in, void* out, int64_t count, int dtype, int op, double scale) {
  auto* c = static_cast<Comm*>(h);
  if (check_op(dtype, op) != kOk) return kUnsupported;
  const int es = elem_size(dtype), W = c->world;
  const int64_t per_chunk = c->slot / es;
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  if (W == 1) {
    pcopy(c, dst, src, count * es);
    if (op == kOpAvg) {
      const void* s[1] = {dst};
      preduce(c, dst, nullptr, s, 1, count, dtype, op, scale);
    }
    return kOk;
  }
  for (int64_t base = 0; base < count; base += per_chunk) {
    const int64_t m = std::min(per_chunk, count - base);
    const uint64_t g = c->chunk++;
    int64_t b, e;
    for (int q = 0; q < W; ++q) {
      if (q == c->rank) continue;
      share(m, W, q, &b, &e);
      pcopy(c, c->buf(c->rank, g) + b * es, src + (base + b) * es, (e - b) * es);
    }
    int rc = phase(c);
    if (rc) return rc;
    share(m, W, c->rank, &b, &e);
    if (e > b) {
      const void* srcs[kMaxRanks];
      srcs[0] = src + (base + b) * es;
      int k = 1;
      for (int q = 0; q < W; ++q)
        if (q != c->rank) srcs[k++] = c->buf(q, g) + b * es;
      if (preduce(c, c->buf(c->rank, g) + b * es, dst + (base + b) * es, srcs, W, e - b, dtype, op, scale))
        return kUnsupported;
    }
    rc = phase(c);
    if (rc) return rc;
    for (int q = 0; q < W; ++q) {
      if (q == c->rank) continue;
      share(m, W, q, &b, &e);
      pcopy(c, dst + (base + b) * es, c->buf(q, g) + b * es, (e - b) * es);
    }
  }
  return kOk;
}

// in holds world blocks of count elements; out (count elements) gets the
// reduction of every rank's block number `rank`.
int gm_reduce_scatter(void* h, const void* in, void* out, int64_t count, int dtype, int op, double scale) {
  auto* c = static_cast<Comm*>(h);
  if (check_op(dtype, op) != kOk) return kUnsupported;
  const int es = elem_size(dtype), W = c->world;
  const int64_t per_chunk = std::max<int64_t>(1, c->slot / es / W / 16 * 16);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  const int64_t region = per_chunk * es;  // bytes per destination in a buffer
  for (int64_t base = 0; base < count; base += per_chunk) {
    const int64_t m = std::min(per_chunk, count - base);
    const uint64_t g = c->chunk++;
    for (int q = 0; q < W; ++q) {
      if (q == c->rank) continue;
      pcopy(c, c->buf(c->rank, g) + q * region, src + (q * count + base) * es, m * es);
    }
    int rc = phase(c);
    if (rc) return rc;
    const void* srcs[kMaxRanks];
    srcs[0] = src + (c->rank * count + base) * es;
    int k = 1;
    for (int q = 0; q < W; ++q)
      if (q != c->rank) srcs[k++] = c->buf(q, g) + c->rank * region;
    if (preduce(c, dst + base * es, nullptr, srcs, W, m, dtype, op, scale)) return kUnsupported;
  }
  return kOk;
}

// out holds world blocks of `bytes`; block r is rank r's input.
int gm_allgather(void* h, const void* in, void* out, int64_t bytes) {
  auto* c = static_cast<Comm*>(h);
  const int W = c->world;
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  pcopy(c, dst + c->rank * bytes, src, bytes);
  for (int64_t base = 0; base < bytes; base += c->slot) {
    const int64_t m = std::min(c->slot, bytes - base);
    const uint64_t g = c->chunk++;
    pcopy(c, c->buf(c->rank, g), src + base, m);
    int rc = phase(c);
    if (rc) return rc;
    for (int q = 0; q < W; ++q)
      if (q != c->rank) pcopy(c, dst + q * bytes + base, c->buf(q, g), m);
  }
  return kOk;
}

int gm_broadcast(void* h, void* data, int64_t bytes, int root) {
  auto* c = static_cast<Comm*>(h);
  if (root < 0 || root >= c->world) return kBadArg;
  char* p = static_cast<char*>(data);
  for (int64_t base = 0; base < bytes; base += c->slot) {
    const int64_t m = std::min(c->slot, bytes - base);
    const uint64_t g = c->chunk++;
    if (c->rank == root) pcopy(c, c->buf(root, g), p + base, m);
    int rc = phase(c);
    if (rc) return rc;
    if (c->rank != root) pcopy(c, p + base, c->buf(root, g), m);
  }
  return kOk;
}

// Equal-split all-to-all: in and out hold world blocks of `bytes`; out block
// q is rank q's in block `rank`.
int gm_alltoall(void* h, const void* in, void* out, int64_t bytes) {
  auto* c = static_cast<Comm*>(h);
  const int W = c->world;
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  // W regions must fit in one buffer: 64-byte aligned when a region can be
  // that large, else as large as fits (slot >= 4096 and W <= 128: >= 32 bytes).
  int64_t region = c->slot / W;
  if (region >= 64) region = region / 64 * 64;
  pcopy(c, dst + c->rank * bytes, src + c->rank * bytes, bytes);
  for (int64_t base = 0; base < bytes; base += region) {
    const int64_t m = std::min(region, bytes - base);
    const uint64_t g = c->chunk++;
    for (int q = 0; q < W; ++q)
      if (q != c->rank) pcopy(c, c->buf(c->rank, g) + q * region, src + q * bytes + base, m);
    int rc = phase(c);
    if (rc) return rc;
    for (int q = 0; q < W; ++q)
      if (q != c->rank) pcopy(c, dst + q * bytes + base, c->buf(q, g) + c->rank * region, m);
  }
  return kOk;
}

// Uneven all-to-all (all_to_all_single with split sizes: an MoE dispatch):
// this rank sends send_bytes[q] bytes from in + send_off[q] to local rank q,
// and receives recv_bytes[q] bytes from q into out + recv_off[q]. Rounds move
// up to `region` bytes per pair through the double buffers, as the equal-split
// path does. No rank knows how many rounds the largest pair needs, so round 0
// also publishes each rank's send and receive sizes (Comm::sizes): after its
// phase every rank reads the same W x W matrix, takes the round count from
// its largest entry, and checks that every pair agrees (what q sends to r is
// what r expects from q). A disagreement fails on every rank alike with
// kBadArg, leaving the group usable, where a rank-local check would leave
// the others waiting for it.
int gm_alltoallv(void* h, const void* in, void* out, const int64_t* send_bytes,
                 const int64_t* send_off, const int64_t* recv_bytes, const int64_t* recv_off) {
  auto* c = static_cast<Comm*>(h);
  const int W = c->world, me = c->rank;
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  int64_t region = c->slot / W;  // as gm_alltoall: W regions in one buffer
  if (region >= 64) region = region / 64 * 64;
  auto piece = [region](int64_t total, int64_t k) {
    return std::max<int64_t>(0, std::min(region, total - k * region));
  };
  int64_t rounds = 1;  // known once round 0's sizes are read
  for (int64_t k = 0; k < rounds; ++k) {
    const uint64_t g = c->chunk++;
    char* mine = c->buf(me, g);
    if (k == 0) {
      std::memcpy(c->sizes(me, g), send_bytes, W * 8);
      std::memcpy(c->sizes(me, g) + W, recv_bytes, W * 8);
    }
    for (int q = 0; q < W; ++q) {
      const int64_t m = q == me ? 0 : piece(send_bytes[q], k);
      if (m > 0) pcopy(c, mine + q * region, src + send_off[q] + k * region, m);
    }
    int rc = phase(c);
    if (rc) return rc;
    if (k == 0) {
      int64_t most = 0;
      for (int q = 0; q < W; ++q) {
        const int64_t* sent = c->sizes(q, g);
        for (int r = 0; r < W; ++r) {
          const int64_t want = c->sizes(r, g)[W + q];
          if (sent[r] != want || sent[r] < 0) {
            // giantmodel/comm/shm.py reads the pair and sizes back out of this text
            c->error = "all_to_all split sizes disagree: local rank " + std::to_string(q) +
                       " sends " + std::to_string(sent[r]) + " bytes to local rank " +
                       std::to_string(r) + ", which expects " + std::to_string(want);
            return kBadArg;
          }
          if (r != q) most = std::max(most, sent[r]);
        }
      }
      rounds = std::max<int64_t>(1, (most + region - 1) / region);
      pcopy(c, dst + recv_off[me], src + send_off[me], send_bytes[me]);
    }
    for (int q = 0; q < W; ++q) {
      const int64_t m = q == me ? 0 : piece(recv_bytes[q], k);
      if (m > 0) pcopy(c, dst + recv_off[q] + k * region, c->buf(q, g) + me * region, m);
    }
  }
  return kOk;
}

// Schedule ring: rank 0 posts the order in which queued operations run, the
// others follow it, so a priority order chosen on one rank is the same on all.
int gm_sched_post(void* h, int64_t k, int64_t op_id) {
  auto* c = static_cast<Comm*>(h);
  // Slot k is free again once every follower consumed entry k - ring.
  if (k >= kSchedRing) {
    for (int q = 1; q < c->world; ++q) {
      int rc = wait_on(c, c->hdr->sched_ack[q], q, static_cast<uint32_t>(k - kSchedRing + 1));
      if (rc) return rc;
    }
  }
  Flag& f = c->hdr->sched_count;
  c->hdr->sched[k % kSchedRing].store(op_id, std::memory_order_relaxed);
  f.value.store(static_cast<uint32_t>(k + 1), std::memory_order_seq_cst);
  if (f.sleepers.load(std::memory_order_seq_cst) > 0) futex(&f.value, FUTEX_WAKE, INT32_MAX, nullptr);
  return kOk;
}

// Follower side: the op id posted at position k, or -status on failure.
int64_t gm_sched_wait(void* h, int64_t k) {
  auto* c = static_cast<Comm*>(h);
  int rc = wait_on(c, c->hdr->sched_count, 0, static_cast<uint32_t>(k + 1));
  if (rc) return -rc;
  int64_t id = c->hdr->sched[k % kSchedRing].load(std::memory_order_relaxed);
  Flag& ack = c->hdr->sched_ack[c->rank];
  ack.value.store(static_cast<uint32_t>(k + 1), std::memory_order_seq_cst);
  if (ack.sleepers.load(std::memory_order_seq_cst) > 0) futex(&ack.value, FUTEX_WAKE, INT32_MAX, nullptr);
  return id;
}

// Memory bandwidth in GB/s of a STREAM-like kernel on `threads` threads over
// arrays of `bytes` each: kind 0 = copy (counts 2 x bytes), 1 = triad (3 x).
double gm_stream(int64_t bytes, int threads, int kind, int reps) {
  const int64_t n = bytes / 8;
  std::vector<double> a(n, 1.0), b(n, 2.0), cc(n, 0.5);
  Pool pool(threads);
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    double t0 = now_s();
    pool.run(n, 8, [&](int64_t lo, int64_t hi) {
      if (kind == 0) std::memcpy(a.data() + lo, b.data() + lo, (hi - lo) * 8);
      else kernels().triad(a.data() + lo, b.data() + lo, cc.data() + lo, 3.0, hi - lo);
    });
    best = std::min(best, now_s() - t0);
  }
  return (kind == 0 ? 2.0 : 3.0) * n * 8 / best / 1e9;
}

}  // extern "C"
