// SPDX-License-Identifier: Apache-2.0
// The flight recorder (pipeline/flight_recorder.hpp): the ring keeps each worker's last 64 actions
// in order, a reader on another thread takes only whole entries (the ThreadSanitizer build runs
// this too), a wait is one word, a dump names the action, the peer and the message, the worker
// loop's failure dumps once per step and only for a wait, and SIGUSR1 dumps through the watcher.
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "cupipe/pipeline/flight_recorder.hpp"

using namespace cupipe;
using pipeline::FlightEntry;
using pipeline::FlightRecorder;
using pipeline::FlightRing;
using schedule::Action;
using schedule::ActionKind;

namespace {

/// A fresh directory for one test's dumps.
std::string fresh_directory(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("cupipe-flight-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  return dir.string();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), {}};
}

}  // namespace

TEST_CASE("a flight ring keeps its worker's last 64 actions, oldest first", "[pipeline][flight]") {
  FlightRing ring;
  CHECK(ring.recent().empty());
  for (int i = 0; i < 100; ++i) {
    ring.begin(Action{i % 2 ? ActionKind::B : ActionKind::F, i, i % 3, i % 5 == 0}, 10.0 + i);
    ring.end(10.5 + i);
  }
  const std::vector<FlightEntry> recent = ring.recent();
  CHECK(ring.count() == 100);
  REQUIRE(recent.size() == FlightRing::capacity);
  for (std::size_t k = 0; k < recent.size(); ++k) {
    const FlightEntry& e = recent[k];
    const int i = 36 + int(k);  // the 36 oldest were overwritten
    CHECK(e.index == std::uint64_t(i));
    CHECK(e.kind == (i % 2 ? ActionKind::B : ActionKind::F));
    CHECK(e.microbatch == i);
    CHECK(e.chunk == i % 3);
    CHECK(e.overlap == (i % 5 == 0));
    CHECK(e.peer == -1);
    CHECK(e.start == 10.0 + i);
    CHECK(e.arrived == 10.0 + i);
    CHECK(e.end == 10.5 + i);
    CHECK_FALSE(e.running());
  }
  CHECK(recent.back().label() == "B99");

  ring.begin(Action{ActionKind::W, 7, 0}, 200.0);  // the 101st, still running, replaces the 37th
  const std::vector<FlightEntry> now = ring.recent();
  REQUIRE(now.size() == FlightRing::capacity);
  CHECK(now.front().index == 37);
  CHECK(now.back().index == 100);
  CHECK(now.back().running());
  CHECK(now.back().label() == "W7");
}

TEST_CASE("a flight ring's wait names the message and the peer until the message is in", "[pipeline][flight]") {
  FlightRing ring;
  ring.begin(Action{ActionKind::B, 3, 1}, 1.0);
  CHECK_FALSE(ring.waiting());
  ring.arrived(1.5);  // not waiting: nothing changes
  CHECK(ring.recent().back().arrived == 1.0);

  const comm::MessageKey key{comm::Flow::gradient, 1023, pipeline::predict_message_id};
  ring.awaiting(4, key);
  const auto wait = ring.waiting();
  REQUIRE(wait);
  CHECK(wait->key == key);
  CHECK(wait->peer == 4);
  CHECK(ring.recent().back().peer == 4);

  ring.arrived(2.25);
  CHECK_FALSE(ring.waiting());
  CHECK(ring.recent().back().arrived == 2.25);
  CHECK(ring.recent().back().running());
}

TEST_CASE("a flight ring read while its worker writes gives only whole entries", "[pipeline][flight]") {
  FlightRing ring;
  constexpr int actions = 20000;
  std::atomic<bool> done{false};
  std::thread worker([&] {
    for (int i = 0; i < actions; ++i) {
      ring.begin(Action{ActionKind::F, i, i % 8}, double(i));
      ring.end(double(i) + 0.5);
    }
    done = true;
  });
  std::size_t read = 0, torn = 0;
  while (!done) {
    for (const FlightEntry& e : ring.recent()) {
      ++read;
      const bool whole = e.microbatch == int(e.index) && e.chunk == int(e.index % 8) && e.start == double(e.index) &&
                         (e.end == double(e.index) + 0.5 || e.running());
      if (!whole) ++torn;
    }
  }
  worker.join();
  CHECK(torn == 0);
  CHECK(ring.count() == std::uint64_t(actions));
  INFO("entries read while written: " << read);
}

TEST_CASE("a flight dump names each worker's action, the peer it waits for and the message", "[pipeline][flight]") {
  const std::string dir = fresh_directory("dump");
  FlightRecorder recorder({true, true, false}, {.directory = dir, .on_signal = false});
  REQUIRE(recorder.path() == dir + "/cupipe-flight-rank-0.json");
  recorder.step_started(std::chrono::steady_clock::now());
  recorder.begin(0, Action{ActionKind::F, 0, 0}, 0.0);
  recorder.end(0, 0.0);
  recorder.begin(0, Action{ActionKind::F, 1, 0}, 0.0);
  recorder.begin(1, Action{ActionKind::F, 0, 0}, 0.0);
  recorder.awaiting(1, 0, {comm::Flow::activation, 1, 0});

  // The transport's own words for the message (describe_message).
  const std::string message = pipeline::describe_message({comm::Flow::activation, 1, 0}, "from", 0);
  const std::string json = recorder.json("test", "a \"quoted\" reason");
  CHECK_THAT(json, Catch::Contains("\"reason\": \"a \\\"quoted\\\" reason\""));
  CHECK_THAT(json, Catch::Contains("\"worker\": 0, \"actions\": 2"));
  CHECK_THAT(json, Catch::Contains("\"current\": {\"index\": 1, \"action\": \"F1\""));
  CHECK_THAT(json, Catch::Contains("\"waiting\": {\"message\": \"" + message +
                                   "\", \"flow\": \"activation\", \"virtual_stage\": 1, \"microbatch\": 0, "
                                   "\"tag\": 2, \"peer_worker\": 0, \"peer_rank\": 0"));
  CHECK_THAT(json, !Catch::Contains("\"worker\": 2"));  // another process's
  const std::string report = recorder.report("test", "why");
  CHECK_THAT(report, Catch::Contains("worker 1: in action F0 for"));
  CHECK_THAT(report, Catch::Contains("waiting for " + message + " (rank 0, tag 2)"));
  CHECK_THAT(report, Catch::Contains("worker 0's last actions, oldest first: F0 F1"));

  // The worker loop's failure dumps only for a worker that waits, and once per step.
  recorder.failed(0, "stage 0, action F1: a layer threw");
  CHECK_FALSE(std::filesystem::exists(recorder.path()));
  recorder.failed(1, "stage 1, action F0: waiting for the activation of microbatch 0 from stage 0: no message");
  REQUIRE(std::filesystem::exists(recorder.path()));
  CHECK_THAT(read_file(recorder.path()), Catch::Contains("\"trigger\": \"wait failed\""));
  std::filesystem::remove(recorder.path());
  recorder.failed(1, "again");
  CHECK_FALSE(std::filesystem::exists(recorder.path()));
  recorder.step_started(std::chrono::steady_clock::now());  // a new step forgets the old waits
  CHECK_FALSE(recorder.ring(1).waiting());
  std::filesystem::remove_all(dir);
}

TEST_CASE("SIGUSR1 makes every recorder of the process dump, from the watcher thread", "[pipeline][flight]") {
  const std::string dir = fresh_directory("signal");
  {
    FlightRecorder first({true}, {.directory = dir});
    FlightRecorder second({true}, {.directory = dir});
    CHECK(second.path() == dir + "/cupipe-flight-rank-0.1.json");  // a file of its own
    struct sigaction installed {};
    REQUIRE(::sigaction(SIGUSR1, nullptr, &installed) == 0);
    CHECK(installed.sa_handler != SIG_DFL);
    first.step_started(std::chrono::steady_clock::now());
    first.begin(0, Action{ActionKind::B, 2, 0}, 0.0);
    REQUIRE(::raise(SIGUSR1) == 0);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!(std::filesystem::exists(first.path()) && std::filesystem::exists(second.path())) &&
           std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    REQUIRE(std::filesystem::exists(first.path()));
    REQUIRE(std::filesystem::exists(second.path()));
    const std::string json = read_file(first.path());
    CHECK_THAT(json, Catch::Contains("\"trigger\": \"signal\""));
    CHECK_THAT(json, Catch::Contains("\"current\": {\"index\": 0, \"action\": \"B2\""));
  }
  struct sigaction restored {};  // the last recorder gave SIGUSR1 its default action back
  REQUIRE(::sigaction(SIGUSR1, nullptr, &restored) == 0);
  CHECK(restored.sa_handler == SIG_DFL);
  std::filesystem::remove_all(dir);
}
