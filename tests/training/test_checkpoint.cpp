// SPDX-License-Identifier: Apache-2.0
// Checkpoints: exact round trips, bit-exact resume, loading across schedules and stage counts, the
// PyTorch layout of the model file, and load errors that name what is wrong instead of crashing.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <set>

#include "training_test_support.hpp"

using namespace cupipe;
using namespace cupipe::test;
namespace fs = std::filesystem;

namespace {

std::vector<char> read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

/// Overwrites one byte in place (no truncation: on ext4 truncating a file flushes it, which is slow).
void poke(const fs::path& path, std::size_t at, char value) {
  std::fstream file(path, std::ios::binary | std::ios::in | std::ios::out);
  file.seekp(std::streamoff(at));
  file.put(value);
}

template <class T>
io::TrainingState sample_state(std::int64_t updates) {
  Rng rng(1234);
  rng.next_u64();
  io::TrainingState state;
  state.updates = updates;
  state.rng = rng.state();
  state.epoch = 3;
  state.batch = 17;
  state.extra = {{"schedule", "1f1b"}, {"stages", "4"}, {"note", "with spaces and \"quotes\""}};
  return state;
}

void require_same_state(const io::TrainingState& a, const io::TrainingState& b) {
  CHECK(a.updates == b.updates);
  CHECK(a.rng == b.rng);
  CHECK(a.epoch == b.epoch);
  CHECK(a.batch == b.batch);
  CHECK(a.extra == b.extra);
}

/// A pipeline trained for `steps` AdamW (or SGD) updates from seed 5, on batches seeded by step.
template <class Pipe, class Optimizer>
void train(Pipe& pipe, const Optimizer& optimizer, int first_step, int steps) {
  for (int s = first_step; s < first_step + steps; ++s) {
    const auto batch = make_batch<typename Pipe::T>(16, 100 + std::uint64_t(s));
    pipe.train_step(batch.inputs(), batch.targets(), optimizer);
  }
}

optim::AdamW scheduled_adamw() {
  // Warm-up over 3 updates, cosine to 10% by update 6: resuming must continue the schedule.
  return optim::AdamW({.lr = 3e-2, .weight_decay = 0.05, .clip_norm = 1.0,
                       .schedule = {.warmup_steps = 3, .total_steps = 6, .min_factor = 0.1}});
}

}  // namespace

TEMPLATE_TEST_CASE("checkpoint round trip restores parameters, optimizer state and training state bitwise",
                   "[cpu][checkpoint]", float, double) {
  using T = TestType;
  ScratchDir dir;
  const fs::path prefix = dir / "ckpt";

  SECTION("AdamW") {
    const auto adamw = scheduled_adamw();
    OneFOneB4<T> pipe({.microbatches = 4, .seed = 5});
    train(pipe, adamw, 0, 3);
    io::save_checkpoint(prefix, pipe, adamw, sample_state<T>(pipe.updates()));

    OneFOneB4<T> fresh({.microbatches = 4, .seed = 99});
    const io::TrainingState loaded = io::load_checkpoint(prefix, fresh, adamw);
    CHECK(bitwise_equal(fresh.parameters(), pipe.parameters()));
    for (std::size_t slot = 0; slot < optim::AdamW::slot_names.size(); ++slot)
      CHECK(bitwise_equal(fresh.optimizer_state(slot), pipe.optimizer_state(slot)));
    CHECK(loaded.optimizer == "adamw");
    require_same_state(loaded, sample_state<T>(3));
    CHECK(fresh.updates() == 3);
  }
  SECTION("SGD with momentum") {
    const optim::SGD sgd({.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3});
    OneFOneB4<T> pipe({.microbatches = 2, .seed = 5});
    train(pipe, sgd, 0, 2);
    io::save_checkpoint(prefix, pipe, sgd, sample_state<T>(pipe.updates()));

    OneFOneB4<T> fresh({.microbatches = 2, .seed = 99});
    const io::TrainingState loaded = io::load_checkpoint(prefix, fresh, sgd);
    CHECK(bitwise_equal(fresh.parameters(), pipe.parameters()));
    CHECK(bitwise_equal(fresh.optimizer_state(0), pipe.optimizer_state(0)));
    CHECK(loaded.optimizer == "sgd");
    require_same_state(loaded, sample_state<T>(2));
    CHECK(fresh.updates() == 2);
  }
  SECTION("a default TrainingState records the trainer's own update count") {
    const auto adamw = scheduled_adamw();
    OneFOneB4<T> pipe({.microbatches = 4, .seed = 5});
    train(pipe, adamw, 0, 2);
    io::save_checkpoint(prefix, pipe, adamw, io::TrainingState{});
    OneFOneB4<T> fresh({.microbatches = 4, .seed = 99});
    CHECK(io::load_checkpoint(prefix, fresh, adamw).updates == 2);
    CHECK(fresh.updates() == 2);
  }
  SECTION("before any update: zero optimizer state, as at the start") {
    const optim::AdamW adamw;
    OneFOneB4<T> pipe({.microbatches = 1, .seed = 5});
    io::save_checkpoint(prefix, pipe, adamw, sample_state<T>(0));
    OneFOneB4<T> fresh({.microbatches = 1, .seed = 6});
    io::load_checkpoint(prefix, fresh, adamw);
    CHECK(bitwise_equal(fresh.parameters(), pipe.parameters()));
    CHECK(bitwise_equal(fresh.optimizer_state(0), std::vector<T>(pipe.parameters().size(), T(0))));
  }
}

TEST_CASE("resuming from a checkpoint is bit-exact: 6 steps == 2 steps, save, load into a new pipeline, 4 steps",
          "[cpu][checkpoint]") {
  constexpr int total = 6, first = 2;
  const auto adamw = scheduled_adamw();
  ScratchDir dir;

  OneFOneB4<float> straight({.microbatches = 4, .seed = 5});
  train(straight, adamw, 0, total);

  {
    OneFOneB4<float> before({.microbatches = 4, .seed = 5});
    train(before, adamw, 0, first);
    io::save_checkpoint(dir / "resume", before, adamw, sample_state<float>(before.updates()));
  }  // the pipeline that saved is gone: only the files carry the state over
  OneFOneB4<float> resumed({.microbatches = 4, .seed = 77});
  const io::TrainingState state = io::load_checkpoint(dir / "resume", resumed, adamw);
  REQUIRE(state.updates == first);
  REQUIRE(resumed.updates() == first);
  train(resumed, adamw, first, total - first);

  CHECK(resumed.updates() == straight.updates());
  CHECK(bitwise_equal(resumed.parameters(), straight.parameters()));
  CHECK(bitwise_equal(resumed.optimizer_state(0), straight.optimizer_state(0)));
  CHECK(bitwise_equal(resumed.optimizer_state(1), straight.optimizer_state(1)));

  // And the check has teeth: resuming without the optimizer state (fresh AdamW moments and LR
  // schedule position) ends somewhere else.
  OneFOneB4<float> params_only({.microbatches = 4, .seed = 5});
  params_only.set_parameters(io::load_model<float>(io::model_file(dir / "resume"), OneFOneB4<float>::parameter_table()));
  train(params_only, adamw, first, total - first);
  CHECK_FALSE(bitwise_equal(params_only.parameters(), straight.parameters()));
}

TEST_CASE("a checkpoint from 1F1B on 4 stages loads into GPipe on 2 stages and into an unsplit Network",
          "[cpu][checkpoint]") {
  using T = double;
  const auto adamw = scheduled_adamw();
  ScratchDir dir;
  OneFOneB4<T> source({.microbatches = 2, .seed = 5});
  train(source, adamw, 0, 3);
  io::save_checkpoint(dir / "x", source, adamw, sample_state<T>(source.updates()));

  GPipe2<T> target({.microbatches = 2, .seed = 11});
  io::load_checkpoint(dir / "x", target, adamw);
  REQUIRE(bitwise_equal(target.parameters(), source.parameters()));
  REQUIRE(bitwise_equal(target.optimizer_state(0), source.optimizer_state(0)));
  REQUIRE(bitwise_equal(target.optimizer_state(1), source.optimizer_state(1)));

  MlpNetwork<T> net(11);
  net.set_parameters(io::load_model<T>(io::model_file(dir / "x"), MlpNetwork<T>::parameter_table()));
  REQUIRE(bitwise_equal(net.parameters(), source.parameters()));

  // The next step: same loss and gradients. With equal microbatch counts the two pipelines run the
  // same arithmetic per microbatch; GPipe accumulates the microbatches' gradients in another order,
  // and the Network runs the batch whole, so those compare within rounding.
  const auto batch = make_batch<T>(16, 555);
  const StepStats from_source = source.forward_backward(batch.inputs(), batch.targets());
  const StepStats from_target = target.forward_backward(batch.inputs(), batch.targets());
  CHECK(from_target.loss == from_source.loss);
  const double net_loss = double(net.forward_backward(batch.inputs(), batch.targets()));
  CHECK(net_loss == Approx(from_source.loss).epsilon(1e-12));

  const std::vector<T> g_source = source.gradients(), g_target = target.gradients(), g_net = net.gradients();
  double diff = 0, scale = 0, diff_net = 0;
  for (std::size_t i = 0; i < g_source.size(); ++i) {
    diff = std::max(diff, std::abs(g_target[i] - g_source[i]));
    diff_net = std::max(diff_net, std::abs(g_net[i] - g_source[i]));
    scale = std::max(scale, std::abs(g_source[i]));
  }
  REQUIRE(scale > 0);
  CHECK(diff / scale < 1e-13);
  CHECK(diff_net / scale < 1e-12);

  // And the next update lands in the same place.
  source.step(adamw);
  target.step(adamw);
  const std::vector<T> p_source = source.parameters(), p_target = target.parameters();
  for (std::size_t i = 0; i < p_source.size(); ++i) REQUIRE(p_target[i] == Approx(p_source[i]).epsilon(1e-12).margin(1e-15));
}

TEST_CASE("the model file is a PyTorch state_dict: layer-index names, Linear weights [out, in], F32",
          "[cpu][checkpoint]") {
  ScratchDir dir;
  const optim::AdamW adamw({.lr = 1e-2});
  OneFOneB4<float> pipe({.microbatches = 2, .seed = 3});
  train(pipe, adamw, 0, 2);  // biases move off zero, so a swapped layout cannot pass by accident
  io::save_checkpoint(dir / "pt", pipe, adamw, sample_state<float>(pipe.updates()));

  const io::SafetensorsFile file = io::SafetensorsFile::load(io::model_file(dir / "pt"));
  const std::map<std::string, std::vector<std::int64_t>> expected{
      {"0.weight", {16, 6}}, {"0.bias", {16}}, {"2.weight", {12, 16}}, {"2.bias", {12}},
      {"4.weight", {8, 12}}, {"4.bias", {8}}, {"6.weight", {3, 8}},    {"6.bias", {3}}};
  std::vector<std::string> expected_names;
  for (const auto& [name, shape] : expected) expected_names.push_back(name);
  CHECK(file.names() == expected_names);
  for (const auto& [name, shape] : expected) {
    INFO(name);
    CHECK(file.at(name).dtype == DType::f32);
    CHECK(file.at(name).shape == shape);
  }
  CHECK(file.metadata().at("format") == "pt");
  // The state file names slots like torch.optim's state, one per parameter.
  const io::SafetensorsFile state = io::SafetensorsFile::load(io::state_file(dir / "pt"));
  CHECK(state.at("0.weight.exp_avg").shape == std::vector<std::int64_t>{16, 6});
  CHECK(state.at("6.bias.exp_avg_sq").shape == std::vector<std::int64_t>{3});
  CHECK(state.size() == 2 * expected.size());

  // A forward pass written against PyTorch's convention, y = x W^T + b with W[out][in], reproduces
  // the pipeline's prediction.
  const auto batch = make_batch<float>(5, 9);
  std::vector<float> predicted(5 * 3);
  pipe.predict(batch.inputs(), TensorView<float>{predicted.data(), Shape{5, 3}});
  std::vector<double> h(batch.x.begin(), batch.x.end());
  std::int64_t width = mlp_in;
  for (const char* layer : {"0", "2", "4", "6"}) {
    const auto w = file.read<float>(std::string(layer) + ".weight", file.at(std::string(layer) + ".weight").shape);
    const auto b = file.read<float>(std::string(layer) + ".bias", file.at(std::string(layer) + ".bias").shape);
    const std::int64_t out = std::int64_t(b.size());
    std::vector<double> next(std::size_t(5 * out));
    for (std::int64_t r = 0; r < 5; ++r)
      for (std::int64_t o = 0; o < out; ++o) {
        double sum = b[std::size_t(o)];
        for (std::int64_t i = 0; i < width; ++i) sum += double(w[std::size_t(o * width + i)]) * h[std::size_t(r * width + i)];
        next[std::size_t(r * out + o)] = std::string(layer) == "6" ? sum : std::max(sum, 0.0);
      }
    h = std::move(next);
    width = out;
  }
  for (std::size_t i = 0; i < predicted.size(); ++i) CHECK(predicted[i] == Approx(h[i]).margin(1e-5));
}

// Hidden: writes mlp.safetensors (the model) and io.safetensors (inputs "x" and Pipeline::predict's
// output "y") to $CUPIPE_TRAINING_EXPORT_DIR for check_model_file.py, which recomputes the forward
// pass in numpy (or PyTorch) from the model file alone.
TEST_CASE("export a trained MLP and its predictions for the Python check", "[.export_model]") {
  const char* dir = std::getenv("CUPIPE_TRAINING_EXPORT_DIR");
  REQUIRE(dir != nullptr);
  const optim::AdamW adamw({.lr = 1e-2});
  OneFOneB4<float> pipe({.microbatches = 2, .seed = 3});
  train(pipe, adamw, 0, 3);
  const std::vector<float> params = pipe.parameters();
  io::save_model(fs::path(dir) / "mlp.safetensors", OneFOneB4<float>::parameter_table(), std::span<const float>(params));
  const auto batch = make_batch<float>(10, 21);
  std::vector<float> predicted(10 * 3);
  pipe.predict(batch.inputs(), TensorView<float>{predicted.data(), Shape{10, 3}});
  const std::vector<io::TensorEntry> io_tensors{io::make_entry("x", {10, 6}, batch.x), io::make_entry("y", {10, 3}, predicted)};
  io::save_safetensors(fs::path(dir) / "io.safetensors", std::span<const io::TensorEntry>(io_tensors));
}

// ---- load errors ------------------------------------------------------------------------------

namespace {
// The same layer count and names as Mlp, different widths: every Linear but the last mismatches.
using WiderMlp = Sequential<Linear<6, 20>, ReLU, Linear<20, 12>, ReLU, Linear<12, 8>, ReLU, Linear<8, 3>>;
using WiderPipe = Pipeline<partition<WiderMlp, 2>, schedule::OneFOneB, backend::Host<float>>;
// One Linear fewer: 6.* missing from the model, present in the file.
using ShorterMlp = Sequential<Linear<6, 16>, ReLU, Linear<16, 12>, ReLU, Linear<12, 3>>;

struct SavedCheckpoint {
  ScratchDir dir;
  fs::path prefix = dir / "ckpt";
  optim::AdamW adamw = optim::AdamW({.lr = 1e-2});
  std::vector<float> params, exp_avg;

  SavedCheckpoint() {
    OneFOneB4<float> pipe({.microbatches = 2, .seed = 5});
    train(pipe, adamw, 0, 2);
    io::save_checkpoint(prefix, pipe, adamw, sample_state<float>(pipe.updates()));
    params = pipe.parameters();
    exp_avg = pipe.optimizer_state(0);
  }

  /// Loads into a fresh pipeline and requires the state saved above, bitwise.
  void require_loadable() {
    OneFOneB4<float> pipe({.microbatches = 2, .seed = 8});
    io::load_checkpoint(prefix, pipe, adamw);
    REQUIRE(bitwise_equal(pipe.parameters(), params));
    REQUIRE(bitwise_equal(pipe.optimizer_state(0), exp_avg));
  }
};

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }
}  // namespace

TEST_CASE("loading a checkpoint of another model names the mismatched tensors with both shapes, in one line", "[cpu][checkpoint][errors]") {
  SavedCheckpoint saved;
  WiderPipe wider({.microbatches = 2});
  const std::string message = error_message([&] { io::load_checkpoint(saved.prefix, wider, saved.adamw); });
  INFO(message);
  CHECK(contains(message, io::model_file(saved.prefix).string()));
  CHECK(contains(message, "'0.weight' is F32 (16, 6) but the model needs F32 (20, 6)"));
  CHECK(contains(message, "'0.bias' is F32 (16,) but the model needs F32 (20,)"));
  CHECK(contains(message, "'2.weight' is F32 (12, 16) but the model needs F32 (12, 20)"));
  CHECK_FALSE(contains(message, "'4.weight'"));  // only what differs
  CHECK_FALSE(contains(message, "'2.bias'"));

  const std::string shorter = error_message(
      [&] { io::load_model<float>(io::model_file(saved.prefix), ShorterMlp::body::parameter_table()); });
  INFO(shorter);
  CHECK(contains(shorter, "'4.weight' is F32 (8, 12) but the model needs F32 (3, 12)"));
  CHECK(contains(shorter, "unexpected tensor '6.weight'"));
  CHECK(contains(shorter, "unexpected tensor '6.bias'"));

  // Nothing in common: the first four differences and a count, not a line per tensor.
  using Unrelated = Sequential<Linear<3, 5>, Linear<5, 7>, Linear<7, 9>>;
  const std::string unrelated = error_message(
      [&] { io::load_model<float>(io::model_file(saved.prefix), Unrelated::body::parameter_table()); });
  INFO(unrelated);
  CHECK(contains(unrelated, "does not fit the model (10 differences): tensor '0.weight' is F32 (16, 6) but the model needs F32 (5, 3)"));
  CHECK(contains(unrelated, "; and 6 more"));
  for (const std::string& m : {message, shorter, unrelated}) CHECK(m.find('\n') == std::string::npos);
}

TEST_CASE("missing and unexpected tensors are named", "[cpu][checkpoint][errors]") {
  SavedCheckpoint saved;
  const io::SafetensorsFile original = io::SafetensorsFile::load(io::model_file(saved.prefix));
  std::vector<io::TensorEntry> edited;
  for (const std::string& name : original.names())
    if (name != "2.bias") edited.push_back(original.at(name));
  edited.push_back(io::make_entry("9.weight", {2}, std::vector<float>{1, 2}));
  const fs::path path = saved.dir / "edited.safetensors";
  io::save_safetensors(path, std::span<const io::TensorEntry>(edited));
  const std::string message = error_message([&] { io::load_model<float>(path, Mlp::body::parameter_table()); });
  INFO(message);
  CHECK(contains(message, path.string()));
  CHECK(contains(message, "missing tensor '2.bias' (12,)"));
  CHECK(contains(message, "unexpected tensor '9.weight'"));
}

TEST_CASE("a float64 model file loaded into a float32 model names both dtypes", "[cpu][checkpoint][errors]") {
  ScratchDir dir;
  OneFOneB4<double> pipe({.microbatches = 1, .seed = 5});
  const std::vector<double> params = pipe.parameters();
  io::save_model(dir / "f64.safetensors", OneFOneB4<double>::parameter_table(), std::span<const double>(params));
  OneFOneB4<float> target({.microbatches = 1});
  const std::vector<float> before = target.parameters();
  const std::string message = error_message(
      [&] { target.set_parameters(io::load_model<float>(dir / "f64.safetensors", OneFOneB4<float>::parameter_table())); });
  INFO(message);
  CHECK(contains(message, "'0.weight' is F64 (16, 6) but the model needs F32 (16, 6)"));
  CHECK(contains(message, "(8 differences)"));
  CHECK(contains(message, "'2.bias' is F64 (12,) but the model needs F32 (12,); and 4 more"));
  CHECK(bitwise_equal(target.parameters(), before));
}

TEST_CASE("an AdamW checkpoint does not load into an SGD trainer", "[cpu][checkpoint][errors]") {
  SavedCheckpoint saved;
  OneFOneB4<float> pipe({.microbatches = 2, .seed = 8});
  const std::vector<float> before = pipe.parameters();
  const std::string message = error_message([&] { io::load_checkpoint(saved.prefix, pipe, optim::SGD{}); });
  INFO(message);
  CHECK(contains(message, io::state_file(saved.prefix).string()));
  CHECK(contains(message, "adamw"));
  CHECK(contains(message, "sgd"));
  CHECK(bitwise_equal(pipe.parameters(), before));  // a refused load changes nothing
}

TEST_CASE("a failed load leaves the trainer as it was", "[cpu][checkpoint][errors]") {
  SavedCheckpoint saved;
  // The model file is fine; the state file lacks one optimizer tensor.
  const io::SafetensorsFile state = io::SafetensorsFile::load(io::state_file(saved.prefix));
  std::vector<io::TensorEntry> kept;
  for (const std::string& name : state.names())
    if (name != "4.weight.exp_avg_sq") kept.push_back(state.at(name));
  io::detail::save_with_checksum(io::state_file(saved.prefix), kept, state.metadata());  // intact, but incomplete

  OneFOneB4<float> pipe({.microbatches = 2, .seed = 8});
  const std::vector<float> before = pipe.parameters();
  const std::string message = error_message([&] { io::load_checkpoint(saved.prefix, pipe, saved.adamw); });
  INFO(message);
  CHECK(contains(message, "missing tensor '4.weight.exp_avg_sq' (8, 12)"));
  CHECK(bitwise_equal(pipe.parameters(), before));
  CHECK(pipe.updates() == 0);
}

TEST_CASE("model and state files from different saves are refused", "[cpu][checkpoint][errors]") {
  SavedCheckpoint saved;
  const std::vector<char> first_state = read_bytes(io::state_file(saved.prefix));
  {
    OneFOneB4<float> pipe({.microbatches = 2, .seed = 5});
    train(pipe, saved.adamw, 0, 3);
    io::save_checkpoint(saved.prefix, pipe, saved.adamw, sample_state<float>(pipe.updates()));
  }
  write_bytes(io::state_file(saved.prefix), first_state);  // a torn pair: new model, old state

  OneFOneB4<float> pipe({.microbatches = 2, .seed = 8});
  const std::string message = error_message([&] { io::load_checkpoint(saved.prefix, pipe, saved.adamw); });
  INFO(message);
  CHECK(contains(message, "different saves"));
  CHECK(contains(message, io::model_file(saved.prefix).string()));
  CHECK(contains(message, io::state_file(saved.prefix).string()));
}

TEST_CASE("edited training-state metadata with a recomputed checksum is range-checked, not trusted",
          "[cpu][checkpoint][errors]") {
  // The checksum catches accidents, not edits: rewrite one value and the checksum as an editor would.
  const auto edit = [](const fs::path& prefix, const std::string& key, const std::string& value) {
    const io::SafetensorsFile file = io::SafetensorsFile::load(io::state_file(prefix));
    std::vector<io::TensorEntry> tensors;
    for (const std::string& name : file.names()) tensors.push_back(file.at(name));
    std::map<std::string, std::string> metadata = file.metadata();
    metadata.erase("checksum");
    metadata[key] = value;
    io::detail::save_with_checksum(io::state_file(prefix), tensors, metadata);
  };
  struct Case {
    std::string key, value, message;
  };
  // batch=-1000 indexed out of bounds, rng=0 0 0 0 hung Rng::below, updates=INT64_MAX overflowed the
  // optimizer's step + 1, epoch=-3 trained the wrong number of epochs.
  const std::vector<Case> cases{
      {"batch", "-1000", "metadata 'batch' is -1000, outside [0, 2^40]"},
      {"epoch", "-3", "metadata 'epoch' is -3, outside [0, 2^40]"},
      {"updates", "9223372036854775807", "metadata 'updates' is 9223372036854775807, outside [0, 2^40]"},
      {"updates", "12x", "metadata 'updates' must be an integer, got '12x'"},
      {"rng", "0 0 0 0", "metadata 'rng' is all zeros, a state the generator never leaves"},
      {"rng", "1 2 three 4", "metadata 'rng' must be four unsigned integers"},
  };
  for (const Case& c : cases) {
    INFO(c.key << " = " << c.value);
    SavedCheckpoint saved;
    edit(saved.prefix, c.key, c.value);
    OneFOneB4<float> pipe({.microbatches = 2, .seed = 8});
    const std::vector<float> before = pipe.parameters();
    const std::string message = error_message([&] { io::load_checkpoint(saved.prefix, pipe, saved.adamw); });
    CHECK(contains(message, c.message));
    CHECK(contains(message, io::state_file(saved.prefix).string()));
    CHECK(pipe.parameters() == before);  // a refused load changes nothing
  }
  // The edit itself is what the checksum accepts: an in-range value loads.
  SavedCheckpoint saved;
  edit(saved.prefix, "batch", "5");
  OneFOneB4<float> pipe({.microbatches = 2, .seed = 8});
  CHECK(io::load_checkpoint(saved.prefix, pipe, saved.adamw).batch == 5);
}

/// What a save killed between its renames leaves, built by hand from two real saves: under `a`, save
/// A's model in place, save B's state in place and B's complete model staged (`b_params`, 2 updates).
struct TornSave {
  ScratchDir dir;
  fs::path a = dir / "a", b = dir / "b";
  optim::AdamW adamw = optim::AdamW({.lr = 1e-2});
  OneFOneB4<float> pipe{{.microbatches = 2, .seed = 5}};
  std::vector<float> b_params;

  TornSave() {
    train(pipe, adamw, 0, 1);
    io::save_checkpoint(a, pipe, adamw, sample_state<float>(1));
    train(pipe, adamw, 1, 1);
    io::save_checkpoint(b, pipe, adamw, sample_state<float>(2));
    b_params = pipe.parameters();
    fs::copy_file(io::state_file(b), io::state_file(a), fs::copy_options::overwrite_existing);
    fs::copy_file(io::model_file(b), io::model_file(a).string() + ".partial");
  }
};

TEST_CASE("a save killed between its two renames loads as the new checkpoint", "[cpu][checkpoint][crash]") {
  // The state file of save B in place, B's complete model staged, A's model still in place: what a
  // kill between the renames leaves. Built by hand from two real saves, so this window is always covered.
  TornSave torn;
  auto& [dir, a, b, adamw, pipe, b_params] = torn;
  REQUIRE(io::detail::completes_torn_pair(io::model_file(a), io::state_file(a)));

  OneFOneB4<float> loader({.microbatches = 2, .seed = 8});
  const io::TrainingState state = io::load_checkpoint(a, loader, adamw);
  CHECK(state.updates == 2);
  CHECK(loader.parameters() == b_params);
  CHECK_FALSE(fs::exists(io::model_file(a).string() + ".partial"));  // the commit was finished
  OneFOneB4<float> again({.microbatches = 2, .seed = 9});
  CHECK(io::load_checkpoint(a, again, adamw).updates == 2);  // and loads normally from now on
}

TEST_CASE("a save that fails after a torn save keeps the torn save's model", "[cpu][checkpoint][crash]") {
  // Save B was killed between its renames (B's state in place, B's model staged). The next save fails
  // while writing (the disk fills up); its cleanup must not take B's staged model with it, so the
  // checkpoint still loads as B.
  TornSave torn;
  auto& [dir, a, b, adamw, pipe, b_params] = torn;

  train(pipe, adamw, 2, 1);
  struct rlimit old_limit {};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &old_limit) == 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old_limit;
  small.rlim_cur = rlim_t(fs::file_size(io::state_file(a)) / 2);
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
  bool failed = false;
  try {
    io::save_checkpoint(a, pipe, adamw, sample_state<float>(3));
  } catch (const cupipe::error&) {
    failed = true;
  }
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  std::signal(SIGXFSZ, old_handler);
  REQUIRE(failed);

  OneFOneB4<float> loader({.microbatches = 2, .seed = 8});
  CHECK(io::load_checkpoint(a, loader, adamw).updates == 2);
  CHECK(loader.parameters() == b_params);
}

TEST_CASE("a save killed by SIGKILL at a random instant always leaves a checkpoint that loads: the old or the new",
          "[cpu][checkpoint][crash]") {
  // A child process saves checkpoints in a loop, each with a distinct update count, until the parent
  // kills it with SIGKILL at a random moment; the parent then loads. Some kills land while the files
  // are written, some between the two renames (the case that once left no loadable checkpoint).
  ScratchDir dir;
  const fs::path prefix = dir / "ckpt";
  const optim::AdamW adamw({.lr = 1e-2});
  OneFOneB4<float> pipe({.microbatches = 2, .seed = 5});
  train(pipe, adamw, 0, 1);
  io::save_checkpoint(prefix, pipe, adamw, sample_state<float>(1));
  Rng rng(77);
  int loaded = 0, torn_recovered = 0;
  std::int64_t last_seen = 1;
  for (int kill = 0; kill < 60; ++kill) {
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {  // never returns into Catch2: saves until killed, or exits 3 if a save throws
      try {
        for (std::int64_t n = last_seen + 1;; ++n) io::save_checkpoint(prefix, pipe, adamw, sample_state<float>(n));
      } catch (...) {
      }
      ::_exit(3);
    }
    ::usleep(useconds_t(rng.below(20'000)));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    REQUIRE(WIFSIGNALED(status));
    torn_recovered += fs::exists(io::model_file(prefix).string() + ".partial") &&
                      io::detail::completes_torn_pair(io::model_file(prefix), io::state_file(prefix));
    OneFOneB4<float> loader({.microbatches = 2, .seed = 8});
    io::TrainingState state;
    REQUIRE_NOTHROW(state = io::load_checkpoint(prefix, loader, adamw));
    CHECK(state.updates >= last_seen);  // never older than a save that completed before
    last_seen = state.updates;
    ++loaded;
  }
  CHECK(loaded == 60);
  INFO("kills between the two renames, recovered from the staged model: " << torn_recovered);
  // A save after the kills removes what they left behind: only the two checkpoint files remain.
  io::save_checkpoint(prefix, pipe, adamw, sample_state<float>(last_seen + 1));
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir.path())) names.insert(entry.path().filename().string());
  CHECK(names == std::set<std::string>{"ckpt.safetensors", "ckpt.state.safetensors"});
}

TEST_CASE("truncated checkpoint files are cupipe::errors", "[cpu][checkpoint][errors]") {
  SavedCheckpoint saved;
  for (const fs::path& path : {io::model_file(saved.prefix), io::state_file(saved.prefix)}) {
    const std::vector<char> bytes = read_bytes(path);
    for (std::size_t keep : {std::size_t(0), std::size_t(5), std::size_t(12), bytes.size() / 3, bytes.size() - 1}) {
      write_bytes(path, std::vector<char>(bytes.begin(), bytes.begin() + std::ptrdiff_t(keep)));
      OneFOneB4<float> pipe({.microbatches = 2});
      const std::string message = error_message([&] { io::load_checkpoint(saved.prefix, pipe, saved.adamw); });
      INFO(path.string() << " cut to " << keep << " bytes: " << message);
      CHECK(contains(message, path.string()));
      CHECK((contains(message, "truncated") || contains(message, "not a safetensors file")));
    }
    write_bytes(path, bytes);
  }
  saved.require_loadable();
}

TEST_CASE("a bit flip anywhere in either checkpoint file is a cupipe::error, never a silent load",
          "[cpu][checkpoint][errors]") {
  SavedCheckpoint saved;
  for (const fs::path& path : {io::model_file(saved.prefix), io::state_file(saved.prefix)}) {
    const std::vector<char> bytes = read_bytes(path);
    // Every byte of the file, with the flipped bit cycling through all eight positions.
    for (std::size_t at = 0; at < bytes.size(); ++at) {
      poke(path, at, char(bytes[at] ^ (1 << (at % 8))));
      OneFOneB4<float> pipe({.microbatches = 2});
      try {
        io::load_checkpoint(saved.prefix, pipe, saved.adamw);
        FAIL_CHECK(path.filename().string() << ": flipping bit " << at % 8 << " of byte " << at << " of " << bytes.size()
                                            << " loaded without an error");
      } catch (const cupipe::error& e) {
        if (!contains(e.message(), path.string()))
          FAIL_CHECK("byte " << at << ": the error does not name " << path.string() << ": " << e.message());
      }
      poke(path, at, bytes[at]);
    }
    REQUIRE(read_bytes(path) == bytes);
  }
  saved.require_loadable();
}

TEST_CASE("a save that fails while writing leaves the previous checkpoint loadable", "[cpu][checkpoint][errors]") {
  SavedCheckpoint saved;
  OneFOneB4<float> pipe({.microbatches = 2, .seed = 5});
  train(pipe, saved.adamw, 0, 4);

  SECTION("the disk fills up during the first file") {
    // RLIMIT_FSIZE makes write() fail with EFBIG past the limit, as a full disk would, half way through
    // the state file (the larger of the two, written first).
    const auto state_bytes = fs::file_size(io::state_file(saved.prefix));
    struct rlimit old_limit {};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &old_limit) == 0);
    const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
    struct rlimit small = old_limit;
    small.rlim_cur = rlim_t(state_bytes / 2);
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
    std::string message;
    try {
      io::save_checkpoint(saved.prefix, pipe, saved.adamw, sample_state<float>(pipe.updates()));
    } catch (const cupipe::error& e) {
      message = e.message();
    }
    ::setrlimit(RLIMIT_FSIZE, &old_limit);
    std::signal(SIGXFSZ, old_handler);
    INFO(message);
    CHECK(contains(message, "write failed"));
    CHECK(contains(message, io::state_file(saved.prefix).string()));
  }
  SECTION("the target is not writable: the state file's name is taken by a directory") {
    ScratchDir other;
    const fs::path prefix = other / "ckpt";
    fs::copy_file(io::model_file(saved.prefix), io::model_file(prefix));
    fs::create_directory(io::state_file(prefix));
    const std::string message =
        error_message([&] { io::save_checkpoint(prefix, pipe, saved.adamw, sample_state<float>(pipe.updates())); });
    INFO(message);
    CHECK(contains(message, io::state_file(prefix).string()));
    CHECK(read_bytes(io::model_file(prefix)) == read_bytes(io::model_file(saved.prefix)));  // untouched
  }
  SECTION("the trainer throws while its parameters are gathered for the model file") {
    struct FailingTrainer {
      OneFOneB4<float>& pipe;
      static std::vector<ParamInfo> parameter_table() { return OneFOneB4<float>::parameter_table(); }
      std::vector<float> optimizer_state(std::size_t slot) { return pipe.optimizer_state(slot); }
      std::vector<float> parameters() { throw cupipe::error("device lost", "", __FILE__, __LINE__); }
    } failing{pipe};
    const std::string message =
        error_message([&] { io::save_checkpoint(saved.prefix, failing, saved.adamw, sample_state<float>(4)); });
    CHECK(contains(message, "device lost"));
  }
  // No temp or staged files are left behind, and the old pair still loads, bit for bit.
  std::set<std::string> files;
  for (const auto& entry : fs::directory_iterator(saved.dir.path())) files.insert(entry.path().filename().string());
  CHECK(files == std::set<std::string>{"ckpt.safetensors", "ckpt.state.safetensors"});
  saved.require_loadable();
}
