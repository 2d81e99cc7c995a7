// SPDX-License-Identifier: Apache-2.0
// Crash consistency at every point of a save: this test program interposes rename, fsync, unlink and
// remove (its own definitions win over the C library's, for every call in the process), counts them
// during a save, and kills a forked saving child with SIGKILL just before the 1st, the 2nd, ... of
// them, until a save completes untouched. After each kill the checkpoint must load, and must be the
// old one or the new one. Each state a kill left is then the start of a second save, killed at each
// of its points in turn (a save that starts after a torn one once lost the model).
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <set>

#include "training_test_support.hpp"

namespace crash {

enum Kind { rename_call, fsync_call, unlink_call, remove_call, kinds };

std::atomic<bool> active{false};  ///< counting (and killing) only around the save under test
std::atomic<int> calls{0};        ///< interposed calls while active
std::atomic<int> kill_at{0};      ///< SIGKILL just before this call (1-based); 0: only count
std::atomic<int> per_kind[kinds];

void point(Kind kind) {
  if (!active) return;
  const int n = ++calls;
  ++per_kind[kind];
  if (n == kill_at) ::raise(SIGKILL);
}

template <class F>
F next(const char* name) {
  void* f = ::dlsym(RTLD_NEXT, name);
  if (!f) ::abort();
  return reinterpret_cast<F>(f);
}

void reset(int kill_before) {
  calls = 0;
  for (auto& k : per_kind) k = 0;
  kill_at = kill_before;
}

}  // namespace crash

extern "C" {
int rename(const char* from, const char* to) noexcept {
  crash::point(crash::rename_call);
  static const auto real = crash::next<int (*)(const char*, const char*)>("rename");
  return real(from, to);
}
int fsync(int fd) {
  crash::point(crash::fsync_call);
  static const auto real = crash::next<int (*)(int)>("fsync");
  return real(fd);
}
int unlink(const char* path) noexcept {
  crash::point(crash::unlink_call);
  static const auto real = crash::next<int (*)(const char*)>("unlink");
  return real(path);
}
int remove(const char* path) noexcept {
  crash::point(crash::remove_call);
  static const auto real = crash::next<int (*)(const char*)>("remove");
  return real(path);
}
}

using namespace cupipe;
using namespace cupipe::test;
namespace fs = std::filesystem;

namespace {

/// The files of a folder, by name.
using Snapshot = std::map<std::string, std::vector<char>>;

Snapshot snapshot(const fs::path& dir) {
  Snapshot out;
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::ifstream in(entry.path(), std::ios::binary);
    out[entry.path().filename().string()] = {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }
  return out;
}

void restore(const fs::path& dir, const Snapshot& files) {
  for (const auto& entry : fs::directory_iterator(dir)) fs::remove(entry.path());
  for (const auto& [name, bytes] : files) {
    std::ofstream out(dir / name, std::ios::binary);
    out.write(bytes.data(), std::streamsize(bytes.size()));
  }
}

io::TrainingState state_with(std::int64_t updates) {
  io::TrainingState state;
  state.updates = updates;
  return state;
}

/// How a save killed at one point ended.
struct Outcome {
  bool completed = false;  ///< the save ran to its end before the kill point
  Snapshot left;           ///< the folder after the kill (before any load touches it)
  std::int64_t loaded = -1;  ///< the update count of the checkpoint that loads; -1: none loads
  std::string error;
};

/// Forks a child that saves the checkpoint `updates` into `prefix` and is killed just before its
/// `kill_before`-th interposed call; then loads in this process.
template <class Pipe>
Outcome save_killed_at(Pipe& pipe, const optim::AdamW& adamw, const fs::path& prefix, std::int64_t updates,
                       int kill_before) {
  std::fflush(nullptr);
  const pid_t child = ::fork();
  if (child < 0) throw std::runtime_error("fork failed");
  if (child == 0) {  // never returns into Catch2
    try {
      crash::reset(kill_before);
      crash::active = true;
      io::save_checkpoint(prefix, pipe, adamw, state_with(updates));
      crash::active = false;
    } catch (...) {
      ::_exit(3);
    }
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  Outcome out;
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
    out.completed = true;
  } else if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGKILL) {
    throw std::runtime_error("the saving child neither finished nor was killed (status " + std::to_string(status) + ")");
  }
  out.left = snapshot(prefix.parent_path());
  OneFOneB4<float> loader({.microbatches = 2, .seed = 8});
  try {
    out.loaded = io::load_checkpoint(prefix, loader, adamw).updates;
  } catch (const std::exception& e) {
    out.error = e.what();
  }
  return out;
}

}  // namespace

TEST_CASE("a save killed at each of its renames, fsyncs and removals in turn leaves a checkpoint that loads: the old or the new",
          "[cpu][checkpoint][crash]") {
  ScratchDir dir;
  const fs::path prefix = dir / "ckpt";
  const optim::AdamW adamw({.lr = 1e-2});
  OneFOneB4<float> pipe({.microbatches = 2, .seed = 5});
  const auto batch = make_batch<float>(16, 100);
  pipe.train_step(batch.inputs(), batch.targets(), adamw);
  io::save_checkpoint(prefix, pipe, adamw, state_with(1));
  const Snapshot first = snapshot(dir.path());

  // Count the points of one save, so that a broken interposer (nothing seen) fails the test.
  crash::reset(0);
  crash::active = true;
  io::save_checkpoint(prefix, pipe, adamw, state_with(2));
  crash::active = false;
  const int points = crash::calls;
  INFO("interposed calls in one save: " << points << " (rename " << crash::per_kind[crash::rename_call] << ", fsync "
                                         << crash::per_kind[crash::fsync_call] << ")");
  REQUIRE(crash::per_kind[crash::rename_call] >= 4);  // two temp files over staged copies, two staged over the pair
  REQUIRE(crash::per_kind[crash::fsync_call] >= 4);   // each file and its folder

  int kills = 0, second_level_kills = 0;
  std::set<std::string> states_seen;
  for (int k = 1;; ++k) {
    restore(dir.path(), first);
    const Outcome a = save_killed_at(pipe, adamw, prefix, 2, k);
    INFO("first save killed before point " << k << ": " << a.error);
    if (a.completed) {
      CHECK(k == points + 1);  // every point was a kill point
      CHECK(a.loaded == 2);
      break;
    }
    ++kills;
    REQUIRE(a.loaded != -1);
    CHECK((a.loaded == 1 || a.loaded == 2));
    std::string names;
    for (const auto& [name, bytes] : a.left) names += name + " ";
    states_seen.insert(names);

    // A second save from what the kill left (before any load repaired it), killed at each point.
    for (int m = 1; m < 200; ++m) {
      restore(dir.path(), a.left);
      const Outcome b = save_killed_at(pipe, adamw, prefix, 3, m);
      INFO("second save killed before point " << m << ": " << b.error);
      if (b.completed) {
        CHECK(b.loaded == 3);
        break;
      }
      ++second_level_kills;
      REQUIRE(b.loaded != -1);
      CHECK((b.loaded == a.loaded || b.loaded == 3));  // never back past a save that had completed
    }
  }
  WARN("a save has " << points << " interposed calls; killed before each: " << kills << " kills, then "
                      << second_level_kills << " kills of a second save started from what each left; "
                      << states_seen.size() << " different folder states");
  CHECK(kills == points);
  CHECK(second_level_kills >= kills * 4);
  CHECK(states_seen.size() >= 3);
}
