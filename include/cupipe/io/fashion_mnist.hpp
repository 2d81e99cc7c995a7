// SPDX-License-Identifier: Apache-2.0
// Fashion-MNIST (Zalando): 60000 training and 10000 test images of 28x28 grey pixels, labels 0..9,
// in four IDX files, gzip'd or plain. Debian's dataset-fashion-mnist installs them in
// /usr/share/datasets/fashion-mnist/.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/io/idx.hpp"

namespace cupipe::io {

/// Images as rows of `features` floats in [0, 1] (pixel / 255), and their class labels.
struct Dataset {
  std::int64_t count = 0;
  std::int64_t features = 0;
  std::vector<float> images;          // (count, features)
  std::vector<std::int32_t> labels;   // (count,)
};

struct FashionMnist {
  Dataset train, test;
};

inline constexpr std::int64_t fashion_mnist_side = 28;
inline constexpr std::int64_t fashion_mnist_classes = 10;
inline constexpr const char* fashion_mnist_default_dir = "/usr/share/datasets/fashion-mnist";

namespace detail {

/// `dir/stem.gz`, else `dir/stem`; throws naming both if neither exists.
inline std::filesystem::path find_idx_file(const std::filesystem::path& dir, const std::string& stem) {
  for (const std::string& name : {stem + ".gz", stem}) {
    std::error_code ignored;
    if (std::filesystem::exists(dir / name, ignored)) return dir / name;
  }
  CUPIPE_THROW(dir.string(), ": no ", stem, ".gz or ", stem, "; expected the four Fashion-MNIST files ",
               "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte ",
               "(each plain or .gz)");
}

inline Dataset load_fashion_mnist_split(const std::filesystem::path& dir, const std::string& prefix) {
  const std::filesystem::path images_path = find_idx_file(dir, prefix + "-images-idx3-ubyte");
  const std::filesystem::path labels_path = find_idx_file(dir, prefix + "-labels-idx1-ubyte");
  const IdxArray images = read_idx(images_path);
  const IdxArray labels = read_idx(labels_path);
  if (images.shape.size() != 3 || images.shape[1] != fashion_mnist_side || images.shape[2] != fashion_mnist_side)
    CUPIPE_THROW(images_path.string(), ": expected images of shape (N, 28, 28) but the file holds ",
                 format_shape(images.shape));
  if (labels.shape.size() != 1)
    CUPIPE_THROW(labels_path.string(), ": expected labels of shape (N,) but the file holds ", format_shape(labels.shape));
  if (labels.shape[0] != images.shape[0])
    CUPIPE_THROW(labels_path.string(), ": has ", labels.shape[0], " labels but ", images_path.string(), " has ",
                 images.shape[0], " images");

  Dataset out;
  out.count = images.shape[0];
  out.features = fashion_mnist_side * fashion_mnist_side;
  out.labels.resize(labels.data.size());
  for (std::size_t i = 0; i < labels.data.size(); ++i) {
    if (labels.data[i] >= fashion_mnist_classes)
      CUPIPE_THROW(labels_path.string(), ": label ", int(labels.data[i]), " at index ", i,
                   " is outside the classes 0..9");
    out.labels[i] = labels.data[i];
  }
  out.images.resize(images.data.size());
  std::transform(images.data.begin(), images.data.end(), out.images.begin(),
                 [](std::uint8_t pixel) { return float(pixel) / 255.0f; });
  return out;
}

}  // namespace detail

/// Loads the training and test splits from `dir`; throws cupipe::error naming the file at fault.
inline FashionMnist load_fashion_mnist(const std::filesystem::path& dir = fashion_mnist_default_dir) {
  std::error_code ignored;
  if (!std::filesystem::is_directory(dir, ignored))
    CUPIPE_THROW(dir.string(), ": not a directory; expected the Fashion-MNIST folder (Debian: apt install "
                 "dataset-fashion-mnist puts it in ", fashion_mnist_default_dir, ")");
  return {detail::load_fashion_mnist_split(dir, "train"), detail::load_fashion_mnist_split(dir, "t10k")};
}

/// Rows [first, first + count) of `data`, copied.
inline Dataset take(const Dataset& data, std::int64_t first, std::int64_t count) {
  CUPIPE_REQUIRE(first >= 0 && count >= 0 && first <= data.count && count <= data.count - first,
                 "take: rows [", first, ", ", first + count, ") are outside the dataset's ", data.count, " rows");
  Dataset out;
  out.count = count;
  out.features = data.features;
  const auto row = [&](std::int64_t r) { return data.images.begin() + r * data.features; };
  out.images.assign(row(first), row(first + count));
  out.labels.assign(data.labels.begin() + first, data.labels.begin() + first + count);
  return out;
}

}  // namespace cupipe::io
