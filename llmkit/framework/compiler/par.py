"""The kernels' thread pool: fork-join over chunks, where the caller never waits for a thread that
has not started.

OpenMP's ``parallel for`` ends in a barrier every thread of the team must reach. A thread the
operating system has set aside (on a machine whose cores the server's event loop and its clients
share) holds up the whole team until it runs again, even when the others could have done its share:
``llmkit serve`` at 32 streams measured no faster with two kernel threads than with one. Here a
loop is ``n`` chunks that any thread claims one at a time (a compare-and-swap on one word: the job's
number, its chunk count and the next chunk); the caller claims chunks too, and when none is left it
waits only for the chunks other threads have claimed and not finished. A helper that wakes late
finds nothing left and goes back to waiting (one set aside in the middle of a chunk it claimed
still holds the caller up until it runs again). Which thread computes a chunk never changes its
result: a kernel's chunks are independent (columns of a product, query tokens of attention), each
computed the same way by whoever claims it.

One pool per process, in its own shared library (``compiler.build`` compiles it into the kernel
cache and loads it with ``RTLD_GLOBAL`` before any kernel, so every kernel library binds to it).
Helpers start at the first parallel loop, as many as it asks for less one; each spins a while
after its last chunk (``set_spin``: inference processes, see ``build.spin_between_kernels``), then
sleeps on a futex.
Two callers at once (two Python threads running kernels), or a chunk that opens a loop itself, run
that loop on their own thread. After ``fork`` the child starts its own helpers.

Every kernel, generated (``codegen_c``: each ``parallel`` loop of the loop IR) or hand-written
(``native/``), runs its threads here: kernels are compiled without OpenMP's runtime
(``-fopenmp-simd``: its SIMD pragmas only), so no OpenMP wait policy or import order decides how
kernel threads wait. The C interface, in every kernel library's prelude (``DECLARE``):
``llmkit_par_run(n, threads, fn, ctx)`` calls ``fn(ctx, chunk, worker)`` once for every chunk in
``0 .. n-1``, on at most ``threads`` threads, and returns when all have returned; ``worker`` is 0
for the caller and 1 .. threads-1 for helpers (an index for per-thread scratch). The pool's own
symbol is declared weak, so a kernel still loads where the pool failed to build (one
``FallbackWarning`` says so): it then runs every chunk on the calling thread.

``counts()`` reads two counters, for tests and profiles: loops handed to helpers, and the claims
helpers ran.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

DECLARE = r"""
typedef void (*llmkit_par_fn)(void *, int64_t, int64_t);
__attribute__((weak)) void llmkit_par_for(int64_t n, int64_t threads, llmkit_par_fn fn, void *ctx);
/* the pool's loop, or every chunk on this thread where the pool is not loaded */
static inline void llmkit_par_run(int64_t n, int64_t threads, llmkit_par_fn fn, void *ctx) {
  if (llmkit_par_for) llmkit_par_for(n, threads, fn, ctx);
  else for (int64_t i = 0; i < n; i++) fn(ctx, i, 0);
}
"""

SOURCE = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

typedef void (*par_fn)(void *, int64_t, int64_t);
enum { MAX_HELPERS = 63 };

/* The job is one word, `state`: its number, its chunk count and the next unclaimed chunk; threads
   claim a chunk with a compare-and-swap expecting the state they read. The job's other fields are
   written before its state is published and rewritten only once all its chunks are finished, so a
   thread that read a state with a chunk left and then claimed it read that very job's fields. */
enum { NEXT_BITS = 19, COUNT_BITS = 19 }; /* claims per job < 2^19 (more chunks: claimed in groups) */
#define CLAIM_MASK ((UINT64_C(1) << NEXT_BITS) - 1)
static struct {
  _Alignas(64) _Atomic uint64_t state;
  _Alignas(64) _Atomic int64_t done; /* claims finished by helpers */
  _Alignas(64) _Atomic int64_t total, group, helpers;
  _Atomic(par_fn) fn;
  _Atomic(void *) ctx;
  _Alignas(64) _Atomic uint32_t wake; /* futex word: bumped at every job */
  _Atomic int sleepers, started, busy;
  _Atomic int64_t spin_ns;
  _Atomic int64_t jobs, helped; /* counters: loops handed to helpers, claims helpers ran */
} P;
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void sleep_until_changed(uint64_t seen) {
  atomic_fetch_add(&P.sleepers, 1);
  const uint32_t w = atomic_load(&P.wake);
  if (atomic_load(&P.state) == seen) {
#ifdef __linux__
    syscall(SYS_futex, &P.wake, FUTEX_WAIT_PRIVATE, w, NULL, NULL, 0);
#else
    (void)w;
    struct timespec t = {0, 50000};
    nanosleep(&t, NULL);
#endif
  }
  atomic_fetch_sub(&P.sleepers, 1);
}

/* Claim and run chunks of the current job while any is left; returns how many claims this thread ran. */
static int64_t work(int64_t me) {
  int64_t ran = 0;
  for (;;) {
    uint64_t s = atomic_load(&P.state);
    const int64_t i = (int64_t)(s & CLAIM_MASK), n = (int64_t)((s >> NEXT_BITS) & CLAIM_MASK);
    if (i >= n || me > atomic_load(&P.helpers)) return ran;
    const par_fn fn = atomic_load(&P.fn);
    void *ctx = atomic_load(&P.ctx);
    const int64_t total = atomic_load(&P.total), g = atomic_load(&P.group);
    if (atomic_compare_exchange_weak(&P.state, &s, s + 1)) {
      for (int64_t c = i * g; c < (i + 1) * g && c < total; c++) fn(ctx, c, me);
      ran++;
      if (me) atomic_fetch_add(&P.done, 1), atomic_fetch_add_explicit(&P.helped, 1, memory_order_relaxed);
    }
  }
}

static void *helper(void *arg) {
  const int64_t me = (int64_t)(intptr_t)arg;
#ifdef __linux__
  pthread_setname_np(pthread_self(), "llmkit-par"); /* as top -H and py-spy show it */
#endif
  for (;;) {
    work(me);
    const uint64_t seen = atomic_load(&P.state);
    const int64_t spin = atomic_load(&P.spin_ns), t0 = spin > 0 ? now_ns() : 0;
    for (int k = 1; atomic_load(&P.state) == seen; k++) {
      relax();
      if (spin <= 0 || ((k & 63) == 0 && now_ns() - t0 > spin)) {
        sleep_until_changed(seen);
        break;
      }
    }
  }
  return NULL;
}

static void after_fork_in_child(void) { /* the helpers did not come along, nor the loop's caller */
  const uint64_t job = (atomic_load(&P.state) >> (NEXT_BITS + COUNT_BITS)) + 1;
  atomic_store(&P.state, job << (NEXT_BITS + COUNT_BITS)); /* no chunk of a parent's loop is left */
  atomic_store(&P.started, 0);
  atomic_store(&P.sleepers, 0);
  atomic_store(&P.busy, 0);
  pthread_mutex_init(&start_lock, NULL);
}

static int64_t ensure_helpers(int64_t want) {
  static int registered = 0;
  if (want > MAX_HELPERS) want = MAX_HELPERS;
  int64_t have = atomic_load(&P.started);
  if (have >= want) return want;
  pthread_mutex_lock(&start_lock);
  if (!registered) registered = pthread_atfork(NULL, NULL, after_fork_in_child) == 0;
  for (have = atomic_load(&P.started); have < want; have++) {
    pthread_t t;
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    const int err = pthread_create(&t, &a, helper, (void *)(intptr_t)(have + 1));
    pthread_attr_destroy(&a);
    if (err) break;
    atomic_store(&P.started, (int)(have + 1));
  }
  pthread_mutex_unlock(&start_lock);
  return have;
}

void llmkit_par_set_spin(int64_t ns) { atomic_store(&P.spin_ns, ns); }

int64_t llmkit_par_helpers(void) { return atomic_load(&P.started); }

void llmkit_par_counts(int64_t *out) { out[0] = atomic_load(&P.jobs), out[1] = atomic_load(&P.helped); }

void llmkit_par_for(int64_t total, int64_t threads, par_fn fn, void *ctx) {
  int idle = 0;
  if (total <= 0) return;
  if (threads < 2 || total < 2 || !atomic_compare_exchange_strong(&P.busy, &idle, 1)) {
    for (int64_t i = 0; i < total; i++) fn(ctx, i, 0);
    return;
  }
  const int64_t helpers = ensure_helpers(threads - 1);
  if (helpers < 1) {
    for (int64_t i = 0; i < total; i++) fn(ctx, i, 0);
    atomic_store(&P.busy, 0);
    return;
  }
  const int64_t limit = (int64_t)CLAIM_MASK, g = (total + limit - 1) / limit, n = (total + g - 1) / g;
  atomic_store(&P.done, 0);
  atomic_store(&P.total, total);
  atomic_store(&P.group, g);
  atomic_store(&P.helpers, helpers);
  atomic_store(&P.fn, fn);
  atomic_store(&P.ctx, ctx);
  const uint64_t job = (atomic_load(&P.state) >> (NEXT_BITS + COUNT_BITS)) + 1;
  atomic_store(&P.state, (job << (NEXT_BITS + COUNT_BITS)) | ((uint64_t)n << NEXT_BITS));
  atomic_fetch_add_explicit(&P.jobs, 1, memory_order_relaxed);
  atomic_fetch_add(&P.wake, 1);
#ifdef __linux__
  if (atomic_load(&P.sleepers) > 0) syscall(SYS_futex, &P.wake, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
#endif
  const int64_t mine = work(0);
  /* only claims a helper made and has not finished are left: wait for those alone */
  for (int k = 0; atomic_load(&P.done) + mine < n;)
    if (k < 4000) relax(), k++;
    else sched_yield();
  atomic_store(&P.busy, 0);
}
"""

_lib: Any = None
_spin_ns = 0


def loaded() -> bool:
    return _lib is not None


def attach(so: Path) -> None:
    """Load the built pool, globally (``compiler.build`` builds it into the kernel cache)."""
    global _lib
    lib = ctypes.CDLL(str(so), mode=ctypes.RTLD_GLOBAL)
    lib.llmkit_par_set_spin.argtypes = [ctypes.c_int64]
    lib.llmkit_par_helpers.restype = ctypes.c_int64
    lib.llmkit_par_set_spin(_spin_ns)
    _lib = lib


def set_spin(ns: int) -> None:
    """How long an idle helper spins before it sleeps (nanoseconds; 0: sleeps at once)."""
    global _spin_ns
    _spin_ns = int(ns)
    if _lib is not None:
        _lib.llmkit_par_set_spin(_spin_ns)


def helpers() -> int:
    """Helper threads the pool has started (0 before its first parallel loop, or when not loaded)."""
    return int(_lib.llmkit_par_helpers()) if _lib is not None else 0


def counts() -> tuple[int, int]:
    """(loops handed to helpers, claims the helpers ran) since the process started; (0, 0) when
    the pool is not loaded."""
    if _lib is None:
        return (0, 0)
    out = (ctypes.c_int64 * 2)()
    _lib.llmkit_par_counts(out)
    return (int(out[0]), int(out[1]))
