#include "pipeline/mnist.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace pipemare {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

void PutBigEndian(std::vector<unsigned char>& out, uint32_t v) {
  out.push_back(static_cast<unsigned char>(v >> 24));
  out.push_back(static_cast<unsigned char>(v >> 16));
  out.push_back(static_cast<unsigned char>(v >> 8));
  out.push_back(static_cast<unsigned char>(v));
}

std::vector<unsigned char> ImageFile(uint32_t count, uint32_t rows, uint32_t cols,
                                     const std::vector<unsigned char>& pixels,
                                     uint32_t magic = 0x00000803) {
  std::vector<unsigned char> out;
  PutBigEndian(out, magic);
  PutBigEndian(out, count);
  PutBigEndian(out, rows);
  PutBigEndian(out, cols);
  out.insert(out.end(), pixels.begin(), pixels.end());
  return out;
}

std::vector<unsigned char> LabelFile(uint32_t count, const std::vector<unsigned char>& labels,
                                     uint32_t magic = 0x00000801) {
  std::vector<unsigned char> out;
  PutBigEndian(out, magic);
  PutBigEndian(out, count);
  out.insert(out.end(), labels.begin(), labels.end());
  return out;
}

// Three 2x2 images.
const std::vector<unsigned char> kPixels = {0,  255, 128, 64,  //
                                            1,  2,   3,   4,   //
                                            10, 20,  200, 254};
const std::vector<unsigned char> kLabels = {7, 0, 9};

float Normalised(unsigned char p) { return (p / 255.0f - 0.1307f) / 0.3081f; }

class MnistTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = testing::TempDir() + "/mnist_test_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    ASSERT_NE(mkdtemp(buf.data()), nullptr);
    dir_ = buf.data();
  }
  void TearDown() override {
    for (const auto& f : files_) std::remove(f.c_str());
    rmdir(dir_.c_str());
  }

  std::string Write(const std::string& name, const std::vector<unsigned char>& bytes) {
    const std::string path = dir_ + "/" + name;
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    files_.push_back(path);
    return path;
  }

  void WriteValidDir() {
    Write(kMnistTrainImages, ImageFile(3, 2, 2, kPixels));
    Write(kMnistTrainLabels, LabelFile(3, kLabels));
    Write(kMnistTestImages, ImageFile(1, 2, 2, {5, 6, 7, 8}));
    Write(kMnistTestLabels, LabelFile(1, {3}));
  }

  std::string dir_;
  std::vector<std::string> files_;
};

TEST_F(MnistTest, LoadsAndNormalisesPixelsAndLabels) {
  const std::string images = Write("img", ImageFile(3, 2, 2, kPixels));
  const std::string labels = Write("lbl", LabelFile(3, kLabels));
  auto ds = LoadIdxPair(images, labels, 0);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ(ds->count, 3);
  EXPECT_EQ(ds->rows, 2);
  EXPECT_EQ(ds->cols, 2);
  EXPECT_EQ(ds->features(), 4);
  ASSERT_EQ(ds->pixels.size(), kPixels.size());
  for (size_t i = 0; i < kPixels.size(); ++i) {
    EXPECT_NEAR(ds->pixels[i], Normalised(kPixels[i]), 1e-6) << i;
  }
  // Spot values computed by hand.
  EXPECT_NEAR(ds->pixels[0], -0.1307 / 0.3081, 1e-5);
  EXPECT_NEAR(ds->pixels[1], (1.0 - 0.1307) / 0.3081, 1e-5);
  EXPECT_EQ(ds->labels, (std::vector<int64_t>{7, 0, 9}));
}

TEST_F(MnistTest, LimitKeepsTheFirstExamples) {
  const std::string images = Write("img", ImageFile(3, 2, 2, kPixels));
  const std::string labels = Write("lbl", LabelFile(3, kLabels));
  auto ds = LoadIdxPair(images, labels, 2);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ(ds->count, 2);
  ASSERT_EQ(ds->pixels.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_NEAR(ds->pixels[i], Normalised(kPixels[i]), 1e-6);
  EXPECT_EQ(ds->labels, (std::vector<int64_t>{7, 0}));

  auto all = LoadIdxPair(images, labels, 10);  // limit above count = all
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->count, 3);
  EXPECT_EQ(all->labels.size(), 3u);
}

TEST_F(MnistTest, MissingFileIsNotFoundWithPath) {
  const std::string labels = Write("lbl", LabelFile(3, kLabels));
  const std::string missing = dir_ + "/no-such-images";
  auto ds = LoadIdxPair(missing, labels, 0);
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(ds.status().message()), HasSubstr(missing));

  const std::string images = Write("img", ImageFile(3, 2, 2, kPixels));
  const std::string missing_labels = dir_ + "/no-such-labels";
  ds = LoadIdxPair(images, missing_labels, 0);
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(ds.status().message()), HasSubstr(missing_labels));
}

TEST_F(MnistTest, BadMagicNumber) {
  // A label file where the image file belongs (1 dimension instead of 3).
  const std::string images = Write("img", ImageFile(3, 2, 2, kPixels, 0x00000801));
  const std::string labels = Write("lbl", LabelFile(3, kLabels));
  auto ds = LoadIdxPair(images, labels, 0);
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ds.status().message()), AllOf(HasSubstr(images), HasSubstr("magic")));

  // gzip's magic (a compressed download).
  const std::string gz = Write("gz", {0x1f, 0x8b, 0x08, 0x00, 0, 0, 0, 0});
  ds = LoadIdxPair(images, gz, 0);
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);

  const std::string good_images = Write("img2", ImageFile(3, 2, 2, kPixels));
  const std::string bad_labels = Write("lbl2", LabelFile(3, kLabels, 0x00000803));
  ds = LoadIdxPair(good_images, bad_labels, 0);
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ds.status().message()), AllOf(HasSubstr(bad_labels), HasSubstr("magic")));
}

TEST_F(MnistTest, TruncatedHeader) {
  const std::string images = Write("img", {0, 0, 8, 3, 0, 0});
  const std::string labels = Write("lbl", LabelFile(3, kLabels));
  auto ds = LoadIdxPair(images, labels, 0);
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ds.status().message()), HasSubstr("truncated"));
}

TEST_F(MnistTest, TruncatedPixels) {
  std::vector<unsigned char> short_pixels(kPixels.begin(), kPixels.begin() + 10);
  const std::string images = Write("img", ImageFile(3, 2, 2, short_pixels));
  const std::string labels = Write("lbl", LabelFile(3, kLabels));
  auto ds = LoadIdxPair(images, labels, 0);
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ds.status().message()), AllOf(HasSubstr(images), HasSubstr("truncated")));
  // With a limit that fits into what is there, the file is good enough.
  auto two = LoadIdxPair(images, labels, 2);
  EXPECT_TRUE(two.ok()) << two.status();
}

TEST_F(MnistTest, TruncatedLabels) {
  const std::string images = Write("img", ImageFile(3, 2, 2, kPixels));
  const std::string labels = Write("lbl", LabelFile(3, {7, 0}));
  auto ds = LoadIdxPair(images, labels, 0);
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ds.status().message()), AllOf(HasSubstr(labels), HasSubstr("truncated")));
}

TEST_F(MnistTest, HeaderClaimingHugeImagesIsTruncatedNotAnAllocation) {
  // A corrupt header that claims 2^20 images of 2^14 x 2^14 pixels (2^48
  // bytes) over a tiny file must be reported as truncated, not make the
  // loader try to allocate the claimed size.
  const std::string images = Write("img", ImageFile(1u << 20, 1u << 14, 1u << 14, kPixels));
  const std::string labels = Write("lbl", LabelFile(1u << 20, kLabels));
  absl::StatusOr<ImageDataset> ds = absl::UnknownError("not run");
  EXPECT_NO_THROW(ds = LoadIdxPair(images, labels, 0));
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument) << ds.status();
  EXPECT_THAT(std::string(ds.status().message()), HasSubstr("truncated"));
}

TEST_F(MnistTest, CountMismatch) {
  const std::string images = Write("img", ImageFile(3, 2, 2, kPixels));
  const std::string labels = Write("lbl", LabelFile(2, {7, 0}));
  auto ds = LoadIdxPair(images, labels, 0);
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ds.status().message()),
              AllOf(HasSubstr("3 images"), HasSubstr("2 labels")));
}

TEST_F(MnistTest, LabelAboveNine) {
  const std::string images = Write("img", ImageFile(3, 2, 2, kPixels));
  const std::string labels = Write("lbl", LabelFile(3, {7, 10, 9}));
  auto ds = LoadIdxPair(images, labels, 0);
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ds.status().message()),
              AllOf(HasSubstr(labels), HasSubstr("label 10"), HasSubstr("index 1")));
}

TEST_F(MnistTest, LoadMnistPicksTheSplit) {
  WriteValidDir();
  auto train = LoadMnist(dir_, true, 0);
  ASSERT_TRUE(train.ok()) << train.status();
  EXPECT_EQ(train->count, 3);
  EXPECT_EQ(train->labels, (std::vector<int64_t>{7, 0, 9}));
  auto test = LoadMnist(dir_ + "/", false, 0);
  ASSERT_TRUE(test.ok()) << test.status();
  EXPECT_EQ(test->count, 1);
  EXPECT_EQ(test->labels, (std::vector<int64_t>{3}));
  EXPECT_NEAR(test->pixels[3], Normalised(8), 1e-6);
}

TEST_F(MnistTest, CheckMnistDirOnEmptyDir) {
  absl::Status st = CheckMnistDir(dir_);
  EXPECT_FALSE(st.ok());
  EXPECT_THAT(std::string(st.message()), AllOf(HasSubstr("data.path"), HasSubstr(dir_)));
}

TEST_F(MnistTest, CheckMnistDirAcceptsValidDir) {
  WriteValidDir();
  EXPECT_TRUE(CheckMnistDir(dir_).ok()) << CheckMnistDir(dir_);
}

TEST_F(MnistTest, CheckMnistDirReportsBadHeader) {
  WriteValidDir();
  Write(kMnistTestImages, LabelFile(1, {3}));  // wrong kind of file
  absl::Status st = CheckMnistDir(dir_);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()),
              AllOf(HasSubstr("data.path"), HasSubstr(kMnistTestImages)));
}

}  // namespace
}  // namespace pipemare
