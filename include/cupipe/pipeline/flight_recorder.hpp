// SPDX-License-Identifier: Apache-2.0
// FlightRecorder: what each worker of this process did last and what it waits for, kept so that a
// rank that hangs can say so. Each worker keeps its last 64 actions (kind, microbatch, chunk, the
// peer whose message it took, start, input and end times) in a FlightRing, and the message it waits
// for in one word. The worker loop (worker_runtime.hpp) writes them; a dump reads them from another
// thread, without locks.
//
// A dump writes a short report to stderr and the whole record to <dir>/cupipe-flight-rank-R.json
// (dir: FlightSetup::directory, else $CUPIPE_FLIGHT_DIR, else the working directory). It is made:
// - when a wait times out: a worker's wait that fails (the mailbox's or a communicator's transfer
//   timeout), or any other wait of the communicator, which tells its timeout observers
//   (Communicator::observe_timeouts: a step's sends, the collectives, a trainer's own sums); at most
//   one dump per step from the worker loop, the first;
// - on SIGUSR1 (mpirun forwards it to every rank). The handler only write()s one byte to a pipe,
//   which is async-signal-safe; a watcher thread (one per process, started with the first recorder,
//   asleep in poll() until then) reads the pipe and dumps every live recorder of the process. The
//   handler is installed only where SIGUSR1 still has its default action, and that is restored with
//   the last recorder; a program with its own handler calls FlightRecorder::request_dump() in it.
// scripts/flight.py merges the ranks' files and names the cycle of waits or the rank that never sent.
//
// Cost per action: begin() is nine stores to the worker's own cache lines and end() one (relaxed or
// release atomics: plain moves on x86), a receive four more; no lock, no allocation, no clock read
// (the times are the runtime's own). Measured: 2 ns per action, 3 to 5 with a receive (g++ -O1, the
// 2-core VM). Each slot is a seqlock of atomics, so a reader never takes half an entry and
// ThreadSanitizer sees no race.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cupipe/comm/communicator.hpp"
#include "cupipe/comm/message.hpp"
#include "cupipe/pipeline/transport.hpp"
#include "cupipe/schedule/action.hpp"

namespace cupipe::pipeline {

/// One action as a FlightRing keeps it; times are seconds of the steady clock.
struct FlightEntry {
  std::uint64_t index = 0;  ///< the worker's count of actions before this one
  schedule::ActionKind kind{};
  int microbatch = 0;
  int chunk = 0;
  bool overlap = false;
  int peer = -1;  ///< the worker whose message it took (the last one, for an overlapped pair); -1: none
  double start = 0;
  double arrived = 0;  ///< when its input was in (start without a message)
  double end = -1;     ///< < 0: still running
  bool running() const noexcept { return end < 0; }
  std::string label() const { return schedule::kind_letter(kind) + std::to_string(microbatch); }
};

/// A worker's wait for a message: the key and the worker that sends it.
struct FlightWait {
  comm::MessageKey key;
  int peer;
};

/// The last `capacity` actions of one worker and its current wait. Written by the worker's thread
/// only; any thread may read it at any time.
class FlightRing {
 public:
  static constexpr std::uint64_t capacity = 64;

  void begin(const schedule::Action& a, double start) noexcept {
    const std::uint64_t n = count_.load(std::memory_order_relaxed);
    Slot& s = slots_[n % capacity];
    // Seqlock: odd while written; the release stores keep the odd mark before the fields, so a
    // reader that sees a field of this action sees the mark change too.
    s.seq.store(2 * n + 1, std::memory_order_relaxed);
    s.what.store(std::uint32_t(a.kind) | std::uint32_t(a.overlap) << 2 | std::uint32_t(a.chunk) << 3,
                 std::memory_order_release);
    s.microbatch.store(a.microbatch, std::memory_order_release);
    s.peer.store(-1, std::memory_order_release);
    s.start.store(start, std::memory_order_release);
    s.arrived.store(start, std::memory_order_release);
    s.end.store(-1, std::memory_order_release);
    s.seq.store(2 * n + 2, std::memory_order_release);
    count_.store(n + 1, std::memory_order_release);
  }
  /// The running action waits for `key` from worker `peer`.
  void awaiting(int peer, const comm::MessageKey& key) noexcept {
    current().peer.store(peer, std::memory_order_relaxed);
    wait_.store(pack(peer, key), std::memory_order_relaxed);
  }
  /// Its message is in (nothing when it was not waiting).
  void arrived(double t) noexcept {
    if (wait_.load(std::memory_order_relaxed) == 0) return;
    wait_.store(0, std::memory_order_relaxed);
    current().arrived.store(t, std::memory_order_relaxed);
  }
  void end(double t) noexcept { current().end.store(t, std::memory_order_relaxed); }
  /// Forgets a wait that failed (at the start of the next step).
  void clear_wait() noexcept { wait_.store(0, std::memory_order_relaxed); }

  /// Actions begun so far.
  std::uint64_t count() const noexcept { return count_.load(std::memory_order_acquire); }
  /// The last min(count, capacity) actions, oldest first, less one being overwritten meanwhile.
  std::vector<FlightEntry> recent() const {
    const std::uint64_t n = count();
    std::vector<FlightEntry> out;
    for (std::uint64_t i = n > capacity ? n - capacity : 0; i < n; ++i) {
      const Slot& s = slots_[i % capacity];
      const std::uint64_t mark = s.seq.load(std::memory_order_acquire);
      if (mark != 2 * i + 2) continue;
      const std::uint32_t what = s.what.load(std::memory_order_acquire);
      FlightEntry e{i,
                    schedule::ActionKind(what & 3),
                    s.microbatch.load(std::memory_order_acquire),
                    int(what >> 3),
                    ((what >> 2) & 1) != 0,
                    s.peer.load(std::memory_order_acquire),
                    s.start.load(std::memory_order_acquire),
                    s.arrived.load(std::memory_order_acquire),
                    s.end.load(std::memory_order_acquire)};
      if (s.seq.load(std::memory_order_relaxed) == mark) out.push_back(e);
    }
    return out;
  }
  /// The message the worker waits for, if it does.
  std::optional<FlightWait> waiting() const noexcept {
    const std::uint64_t w = wait_.load(std::memory_order_acquire);
    if (w == 0) return std::nullopt;
    const comm::MessageKey key{comm::Flow((w >> 62) & 1), int((w >> 30) & 0xFFFF), int(w & 0x3FFFFFFF)};
    return FlightWait{key, int((w >> 46) & 0xFFFF)};
  }

 private:
  struct Slot {
    std::atomic<std::uint64_t> seq{0};
    std::atomic<std::uint32_t> what{0};  ///< kind | overlap << 2 | chunk << 3
    std::atomic<std::int32_t> microbatch{0};
    std::atomic<std::int32_t> peer{-1};
    std::atomic<double> start{0};
    std::atomic<double> arrived{0};
    std::atomic<double> end{-1};
  };
  static_assert(std::atomic<double>::is_always_lock_free && std::atomic<std::uint64_t>::is_always_lock_free);

  Slot& current() noexcept { return slots_[(count_.load(std::memory_order_relaxed) - 1) % capacity]; }
  /// valid << 63 | flow << 62 | peer (16 bits) << 46 | virtual stage (16) << 30 | microbatch (30).
  static std::uint64_t pack(int peer, const comm::MessageKey& key) noexcept {
    return std::uint64_t(1) << 63 | std::uint64_t(key.flow) << 62 | (std::uint64_t(peer) & 0xFFFF) << 46 |
           (std::uint64_t(key.virtual_stage) & 0xFFFF) << 30 | (std::uint64_t(key.microbatch) & 0x3FFFFFFF);
  }

  std::array<Slot, capacity> slots_{};
  std::atomic<std::uint64_t> count_{0};
  std::atomic<std::uint64_t> wait_{0};
};

/// Where a FlightRecorder writes and what it listens to.
struct FlightSetup {
  /// The ranks' communicator (null: one process): names the rank and the peers' ranks, and its
  /// timeouts dump.
  std::shared_ptr<comm::Communicator> communicator{};
  /// Empty: $CUPIPE_FLIGHT_DIR, else the working directory.
  std::string directory{};
  /// Dump on SIGUSR1 (where it still has its default action).
  bool on_signal = true;
};

class FlightRecorder;

namespace detail {

/// The write end of the watcher's pipe: the signal handler's only state.
inline std::atomic<int> flight_pipe{-1};

/// SIGUSR1: one byte into the pipe. write() is async-signal-safe, and so is a lock-free atomic load.
inline void flight_signal_handler(int) {
  const int saved = errno;
  const int fd = flight_pipe.load(std::memory_order_relaxed);
  if (fd >= 0) {
    const char byte = 'd';
    [[maybe_unused]] const ssize_t written = ::write(fd, &byte, 1);
  }
  errno = saved;
}

/// The process's live recorders and the thread that dumps them when the pipe has a byte. Made once
/// and never destroyed, as its pipe and thread: a late signal still finds them.
class FlightWatcher {
 public:
  static FlightWatcher& instance() {
    static FlightWatcher* watcher = new FlightWatcher;
    return *watcher;
  }
  /// Adds `recorder`; named(n) runs first, under the lock, with the number of recorders live before.
  template <class Named>
  void join(FlightRecorder* recorder, bool on_signal, Named&& named);
  void leave(FlightRecorder* recorder);

 private:
  void start();
  void watch(int fd);

  std::mutex mutex_;
  std::vector<FlightRecorder*> recorders_;
  int pipe_[2] = {-1, -1};
  bool handler_ = false;
  struct sigaction previous_ {};
};

}  // namespace detail

/// The flight recorder of one Pipeline's workers in this process (WorkerRuntime owns it).
class FlightRecorder {
 public:
  /// `local[w]`: whether worker w runs in this process (the others have no ring to show).
  FlightRecorder(std::vector<bool> local, FlightSetup setup = {})
      : local_(std::move(local)), rings_(local_.size()), setup_(std::move(setup)) {
    const comm::Communicator* c = setup_.communicator.get();
    rank_ = c ? c->topology().rank : 0;
    std::string dir = setup_.directory;
    if (const char* env = std::getenv("CUPIPE_FLIGHT_DIR"); dir.empty() && env && *env) dir = env;
    if (dir.empty()) dir = ".";
    // Another pipeline of this process that records too: a file of its own.
    detail::FlightWatcher::instance().join(this, setup_.on_signal, [&](int before) {
      path_ = dir + "/cupipe-flight-rank-" + std::to_string(rank_) + (before ? "." + std::to_string(before) : "") + ".json";
    });
    if (setup_.communicator)
      observer_ = setup_.communicator->observe_timeouts([this](const std::string& what) {
        dumped_in_step_.store(true);  // a worker's receive that timed out: the worker loop adds no second dump
        dump("timeout", what);
      });
  }
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;
  ~FlightRecorder() {
    if (setup_.communicator) setup_.communicator->forget_timeout_observer(observer_);
    detail::FlightWatcher::instance().leave(this);
  }

  // The worker loop's calls. begin to end: worker w's thread; times are seconds after `origin`.
  void step_started(std::chrono::steady_clock::time_point origin) noexcept {
    origin_.store(seconds(origin), std::memory_order_relaxed);
    for (FlightRing& ring : rings_) ring.clear_wait();
    dumped_in_step_.store(false, std::memory_order_relaxed);
    steps_.fetch_add(1, std::memory_order_relaxed);
    running_.store(true, std::memory_order_release);
  }
  void step_ended() noexcept { running_.store(false, std::memory_order_release); }
  void begin(int w, const schedule::Action& a, double t) noexcept { rings_[std::size_t(w)].begin(a, at(t)); }
  void awaiting(int w, int peer, const comm::MessageKey& key) noexcept { rings_[std::size_t(w)].awaiting(peer, key); }
  void arrived(int w, double t) noexcept { rings_[std::size_t(w)].arrived(at(t)); }
  void end(int w, double t) noexcept { rings_[std::size_t(w)].end(at(t)); }
  /// Worker w's action failed with `what`: a dump if it failed while waiting (a timeout) and none
  /// was made in this step yet.
  void failed(int w, const std::string& what) {
    if (rings_[std::size_t(w)].waiting() && !dumped_in_step_.exchange(true)) dump("wait failed", what);
  }

  /// Writes the record to stderr (short) and to path() (JSON), replacing an earlier dump; returns
  /// whether the file was written. Never throws: a dump happens on the way to an error.
  bool dump(const std::string& trigger, const std::string& reason) noexcept;
  /// The record as JSON, and the short report.
  std::string json(const std::string& trigger, const std::string& reason) const;
  std::string report(const std::string& trigger, const std::string& reason) const;

  const FlightRing& ring(int w) const { return rings_.at(std::size_t(w)); }
  const std::string& path() const noexcept { return path_; }
  /// What SIGUSR1 does: every recorder of the process dumps (on the watcher thread). Async-signal-safe.
  static void request_dump() noexcept { detail::flight_signal_handler(SIGUSR1); }

 private:
  static double seconds(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(t.time_since_epoch()).count();
  }
  double at(double t) const noexcept { return origin_.load(std::memory_order_relaxed) + t; }
  int peer_rank(int worker) const {
    if (!setup_.communicator) return rank_;
    const comm::Topology& t = setup_.communicator->topology();
    return t.rank_of(worker, t.replica(), t.tensor_rank());
  }
  std::string entry_json(const FlightEntry& e, double now) const;
  std::string wait_json(const FlightWait& wait, const FlightEntry* current, double now) const;

  std::vector<bool> local_;
  std::vector<FlightRing> rings_;
  FlightSetup setup_;
  int rank_ = 0;
  std::string path_;
  int observer_ = 0;
  std::atomic<double> origin_{0};
  std::atomic<std::int64_t> steps_{0};
  std::atomic<bool> running_{false};
  std::atomic<bool> dumped_in_step_{false};
  std::mutex dump_mutex_;  ///< one dump at a time
};

namespace detail {

inline std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') out += {'\\', c};
    else if (static_cast<unsigned char>(c) < 0x20) {
      char code[8];
      std::snprintf(code, sizeof code, "\\u%04x", unsigned(static_cast<unsigned char>(c)));
      out += code;
    } else out += c;
  }
  return out + "\"";
}

inline std::string json_seconds(double s) {
  char text[32];
  std::snprintf(text, sizeof text, "%.6f", s);
  return text;
}

}  // namespace detail

inline std::string FlightRecorder::entry_json(const FlightEntry& e, double now) const {
  std::ostringstream o;
  o << "{\"index\": " << e.index << ", \"action\": \"" << e.label() << "\", \"kind\": \"" << schedule::kind_letter(e.kind)
    << "\", \"microbatch\": " << e.microbatch << ", \"chunk\": " << e.chunk
    << ", \"overlap\": " << (e.overlap ? "true" : "false") << ", \"peer_worker\": " << e.peer << ", \"peer_rank\": "
    << (e.peer >= 0 ? std::to_string(peer_rank(e.peer)) : "null")
    << ", \"started_ago\": " << detail::json_seconds(now - e.start)
    << ", \"input_ago\": " << detail::json_seconds(now - e.arrived)
    << ", \"ended_ago\": " << (e.running() ? "null" : detail::json_seconds(now - e.end))
    << ", \"running\": " << (e.running() ? "true" : "false") << "}";
  return o.str();
}

inline std::string FlightRecorder::wait_json(const FlightWait& wait, const FlightEntry* current, double now) const {
  std::ostringstream o;
  o << "{\"message\": " << detail::json_string(describe_message(wait.key, "from", wait.peer)) << ", \"flow\": \""
    << (wait.key.flow == comm::Flow::activation ? "activation" : "gradient")
    << "\", \"virtual_stage\": " << wait.key.virtual_stage << ", \"microbatch\": " << wait.key.microbatch
    << ", \"tag\": " << comm::message_tag(wait.key) << ", \"peer_worker\": " << wait.peer
    << ", \"peer_rank\": " << peer_rank(wait.peer)
    << ", \"since_input_ago\": " << (current ? detail::json_seconds(now - current->arrived) : "null") << "}";
  return o.str();
}

inline std::string FlightRecorder::json(const std::string& trigger, const std::string& reason) const {
  const double now = seconds(std::chrono::steady_clock::now());
  const comm::Topology t = setup_.communicator ? setup_.communicator->topology() : comm::Topology{};
  char host[256] = "";
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  std::ostringstream o;
  o << "{\n  \"format\": \"cupipe-flight-1\",\n  \"rank\": " << t.rank << ",\n  \"world\": " << t.world
    << ",\n  \"stage\": " << t.stage() << ",\n  \"replica\": " << t.replica() << ",\n  \"tensor_rank\": " << t.tensor_rank()
    << ",\n  \"across_processes\": " << (setup_.communicator ? "true" : "false") << ",\n  \"pid\": " << ::getpid()
    << ",\n  \"host\": " << detail::json_string(host) << ",\n  \"trigger\": " << detail::json_string(trigger)
    << ",\n  \"reason\": " << detail::json_string(reason) << ",\n  \"wall_time\": "
    << detail::json_seconds(std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count())
    << ",\n  \"steps_started\": " << steps_.load() << ",\n  \"in_step\": " << (running_.load() ? "true" : "false")
    << ",\n  \"workers\": [";
  const char* separator = "";
  for (std::size_t w = 0; w < rings_.size(); ++w) {
    if (!local_[w]) continue;
    const std::vector<FlightEntry> recent = rings_[w].recent();
    const FlightEntry* current = !recent.empty() && recent.back().running() ? &recent.back() : nullptr;
    const std::optional<FlightWait> wait = rings_[w].waiting();
    o << separator << "\n    {\"worker\": " << w << ", \"actions\": " << rings_[w].count()
      << ",\n     \"current\": " << (current ? entry_json(*current, now) : "null")
      << ",\n     \"waiting\": " << (wait ? wait_json(*wait, current, now) : "null") << ",\n     \"recent\": [";
    for (std::size_t i = 0; i < recent.size(); ++i) o << (i ? ",\n       " : "\n       ") << entry_json(recent[i], now);
    o << "]}";
    separator = ",";
  }
  o << "\n  ]\n}\n";
  return o.str();
}

inline std::string FlightRecorder::report(const std::string& trigger, const std::string& reason) const {
  const double now = seconds(std::chrono::steady_clock::now());
  std::ostringstream o;
  o.precision(3);
  o << std::fixed << "cupipe flight recorder: rank " << rank_;
  if (setup_.communicator) {
    const comm::Topology& t = setup_.communicator->topology();
    o << " of " << t.world << " (stage " << t.stage() << ", replica " << t.replica() << ")";
  }
  o << ", pid " << ::getpid() << ", " << trigger << ": " << reason << "\n";
  for (std::size_t w = 0; w < rings_.size(); ++w) {
    if (!local_[w]) continue;
    const std::vector<FlightEntry> recent = rings_[w].recent();
    o << "  worker " << w << ": ";
    if (recent.empty() || !recent.back().running()) o << (running_.load() ? "between actions" : "not in a step");
    else o << "in action " << recent.back().label() << " for " << now - recent.back().start << " s";
    if (const std::optional<FlightWait> wait = rings_[w].waiting())
      o << ", waiting for " << describe_message(wait->key, "from", wait->peer) << " (rank " << peer_rank(wait->peer)
        << ", tag " << comm::message_tag(wait->key) << ")";
    o << "\n  worker " << w << "'s last actions, oldest first:";
    for (const FlightEntry& e : recent) o << " " << e.label() << (e.chunk ? "/" + std::to_string(e.chunk) : "");
    o << "\n";
  }
  return o.str();
}

inline bool FlightRecorder::dump(const std::string& trigger, const std::string& reason) noexcept {
  try {
    const std::lock_guard lock(dump_mutex_);
    const std::string text = json(trigger, reason);
    std::error_code ignored;
    std::filesystem::create_directories(std::filesystem::path(path_).parent_path(), ignored);
    const std::string temporary = path_ + ".tmp" + std::to_string(::getpid());
    bool written = false;
    if (std::FILE* f = std::fopen(temporary.c_str(), "w")) {
      written = std::fwrite(text.data(), 1, text.size(), f) == text.size();
      written = std::fclose(f) == 0 && written && std::rename(temporary.c_str(), path_.c_str()) == 0;
    }
    const std::string shown =
        report(trigger, reason) + (written ? "  written to " + path_ : "  could not write " + path_) + "\n";
    std::fputs(shown.c_str(), stderr);
    std::fflush(stderr);
    return written;
  } catch (...) {
    return false;
  }
}

namespace detail {

template <class Named>
void FlightWatcher::join(FlightRecorder* recorder, bool on_signal, Named&& named) {
  const std::lock_guard lock(mutex_);
  named(int(recorders_.size()));
  recorders_.push_back(recorder);
  if (pipe_[0] < 0) start();
  struct sigaction current {};
  if (on_signal && !handler_ && pipe_[0] >= 0 && ::sigaction(SIGUSR1, nullptr, &current) == 0 &&
      current.sa_handler == SIG_DFL && !(current.sa_flags & SA_SIGINFO)) {
    struct sigaction action {};
    action.sa_handler = flight_signal_handler;
    ::sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    handler_ = ::sigaction(SIGUSR1, &action, &previous_) == 0;
  }
}

inline void FlightWatcher::leave(FlightRecorder* recorder) {
  const std::lock_guard lock(mutex_);
  std::erase(recorders_, recorder);
  if (recorders_.empty() && handler_) ::sigaction(SIGUSR1, &previous_, nullptr);
  if (recorders_.empty()) handler_ = false;
}

/// The pipe (both ends non-blocking: the handler never waits) and the thread. Without a pipe,
/// nothing dumps on request; the timeouts still do.
inline void FlightWatcher::start() {
  if (::pipe(pipe_) != 0) {
    pipe_[0] = pipe_[1] = -1;
    return;
  }
  for (const int fd : pipe_) {
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
    ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  }
  flight_pipe.store(pipe_[1]);
  std::thread([this, fd = pipe_[0]] { watch(fd); }).detach();
}

/// Waits for bytes in the pipe; each batch dumps every live recorder once.
inline void FlightWatcher::watch(int fd) {
  for (;;) {
    pollfd readable{fd, POLLIN, 0};
    if (::poll(&readable, 1, -1) < 0 && errno != EINTR) return;
    char bytes[64];
    bool requested = false;
    for (ssize_t n; (n = ::read(fd, bytes, sizeof bytes)) > 0;) requested = true;
    if (!requested) continue;
    const std::lock_guard lock(mutex_);
    for (FlightRecorder* r : recorders_) r->dump("signal", "SIGUSR1 (or FlightRecorder::request_dump)");
  }
}

}  // namespace detail

}  // namespace cupipe::pipeline
