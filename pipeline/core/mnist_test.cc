#include "pipeline/core/mnist.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>
#include <zlib.h>

#include <cmath>
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

// --- gzip, and the "idx" dataset type ---------------------------------------

// `bytes` gzipped in memory (gzip wrapper: windowBits 15 + 16).
std::vector<unsigned char> Gzipped(const std::vector<unsigned char>& bytes) {
  z_stream z{};
  EXPECT_EQ(deflateInit2(&z, Z_BEST_COMPRESSION, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY), Z_OK);
  std::vector<unsigned char> out(deflateBound(&z, bytes.size()) + 32);
  z.next_in = const_cast<unsigned char*>(bytes.data());
  z.avail_in = bytes.size();
  z.next_out = out.data();
  z.avail_out = out.size();
  EXPECT_EQ(deflate(&z, Z_FINISH), Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

TEST_F(MnistTest, GzippedFilesLoadLikePlainOnes) {
  const std::string images = Write("img.gz", Gzipped(ImageFile(3, 2, 2, kPixels)));
  const std::string labels = Write("lbl.gz", Gzipped(LabelFile(3, kLabels)));
  auto ds = LoadIdxPair(images, labels, 0);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ(ds->count, 3);
  EXPECT_EQ(ds->rows, 2);
  EXPECT_EQ(ds->cols, 2);
  for (size_t i = 0; i < kPixels.size(); ++i) {
    EXPECT_NEAR(ds->pixels[i], Normalised(kPixels[i]), 1e-6) << i;
  }
  EXPECT_EQ(ds->labels, (std::vector<int64_t>{7, 0, 9}));
  // A gzipped image file with a plain label file.
  const std::string plain_labels = Write("lbl", LabelFile(3, kLabels));
  EXPECT_TRUE(LoadIdxPair(images, plain_labels, 2).ok());
}

TEST_F(MnistTest, CorruptGzipNamesTheFile) {
  const std::string labels = Write("lbl", LabelFile(3, kLabels));
  // A gzip header followed by bytes that are no deflate stream.
  std::vector<unsigned char> garbage = Gzipped(ImageFile(3, 2, 2, kPixels));
  for (size_t i = 10; i < garbage.size(); ++i) garbage[i] = 0xff;
  const std::string bad = Write("bad.gz", garbage);
  auto ds = LoadIdxPair(bad, labels, 0);
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ds.status().message()), AllOf(HasSubstr(bad), HasSubstr("corrupt gzip")));

  // A gzip stream cut in the middle (a partial download).
  std::vector<unsigned char> cut = Gzipped(ImageFile(3, 2, 2, kPixels));
  cut.resize(cut.size() / 2);
  const std::string short_gz = Write("cut.gz", cut);
  ds = LoadIdxPair(short_gz, labels, 0);
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ds.status().message()),
              AllOf(HasSubstr(short_gz), HasSubstr("corrupt gzip")));
}

TEST_F(MnistTest, GzipThatHoldsLessThanTheHeaderPromisesIsTruncated) {
  const std::string labels = Write("lbl.gz", Gzipped(LabelFile(3, {7, 0})));  // 2 of 3
  const std::string images = Write("img", ImageFile(3, 2, 2, kPixels));
  auto ds = LoadIdxPair(images, labels, 0);
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ds.status().message()), AllOf(HasSubstr(labels), HasSubstr("truncated")));
}

TEST_F(MnistTest, LoadMnistFindsGzippedStandardNames) {
  Write(std::string(kMnistTrainImages) + ".gz", Gzipped(ImageFile(3, 2, 2, kPixels)));
  Write(std::string(kMnistTrainLabels) + ".gz", Gzipped(LabelFile(3, kLabels)));
  Write(kMnistTestImages, ImageFile(1, 2, 2, {5, 6, 7, 8}));  // plain and gzipped mixed
  Write(std::string(kMnistTestLabels) + ".gz", Gzipped(LabelFile(1, {3})));
  auto train = LoadMnist(dir_, true, 0);
  ASSERT_TRUE(train.ok()) << train.status();
  EXPECT_EQ(train->labels, (std::vector<int64_t>{7, 0, 9}));
  auto test = LoadMnist(dir_, false, 0);
  ASSERT_TRUE(test.ok()) << test.status();
  EXPECT_EQ(test->labels, (std::vector<int64_t>{3}));
}

// A small "idx" dataset: 3x5 images (not MNIST's size), labels 0..4.
constexpr int kRows = 3, kCols = 5, kTrainCount = 4;
const std::vector<int64_t> kIdxTrainLabels = {0, 1, 4, 2};

std::vector<unsigned char> IdxTrainPixels() {
  std::vector<unsigned char> p;
  for (int i = 0; i < kTrainCount * kRows * kCols; ++i)
    p.push_back(static_cast<unsigned char>(i * 4));
  return p;
}

struct MeanStd {
  double mean, std;
};
MeanStd Stats(const std::vector<unsigned char>& pixels) {
  double sum = 0, sq = 0;
  for (unsigned char p : pixels) sum += p / 255.0, sq += (p / 255.0) * (p / 255.0);
  const double mean = sum / pixels.size();
  return {mean, std::sqrt(sq / pixels.size() - mean * mean)};
}
MeanStd Stats(const std::vector<float>& pixels) {
  double sum = 0, sq = 0;
  for (float p : pixels) sum += p, sq += double{p} * p;
  const double mean = sum / pixels.size();
  return {mean, std::sqrt(sq / pixels.size() - mean * mean)};
}

class IdxTest : public MnistTest {
 protected:
  // Writes the four files under the standard names (train gzipped, test plain).
  void WriteIdxDir() {
    Write(std::string(kMnistTrainImages) + ".gz",
          Gzipped(ImageFile(kTrainCount, kRows, kCols, IdxTrainPixels())));
    std::vector<unsigned char> labels(kIdxTrainLabels.begin(), kIdxTrainLabels.end());
    Write(std::string(kMnistTrainLabels) + ".gz", Gzipped(LabelFile(kTrainCount, labels)));
    Write(kMnistTestImages, ImageFile(2, kRows, kCols, std::vector<unsigned char>(30, 200)));
    Write(kMnistTestLabels, LabelFile(2, {3, 0}));
  }
  v1::DataSpec DirSpec() const {
    v1::DataSpec d;
    d.set_type("idx");
    d.set_path(dir_);
    return d;
  }
  // A job over DirSpec() with an MLP of these widths.
  v1::JobSpec Job(std::vector<int> layers) const {
    v1::JobSpec spec;
    spec.mutable_model()->set_type("mlp");
    for (int w : layers) spec.mutable_model()->add_layers(w);
    *spec.mutable_data() = DirSpec();
    return spec;
  }
};

TEST_F(IdxTest, SizesAndClassesComeFromTheFilesAndTrainStatsNormalise) {
  WriteIdxDir();
  auto data = LoadDataset(DirSpec());
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->classes, 5);
  EXPECT_EQ(data->train.count, kTrainCount);
  EXPECT_EQ(data->train.rows, kRows);
  EXPECT_EQ(data->train.cols, kCols);
  EXPECT_EQ(data->train.labels, kIdxTrainLabels);
  EXPECT_EQ(data->test.count, 2);
  EXPECT_EQ(data->test.features(), kRows * kCols);
  EXPECT_EQ(data->test.labels, (std::vector<int64_t>{3, 0}));
  // Mean and std of the training pixels, by hand; the training split comes
  // out with mean 0 and std 1, the test split with the same transform.
  const MeanStd expected = Stats(IdxTrainPixels());
  EXPECT_NEAR(data->normalisation.mean, expected.mean, 1e-6);
  EXPECT_NEAR(data->normalisation.std, expected.std, 1e-6);
  const MeanStd train = Stats(data->train.pixels);
  EXPECT_NEAR(train.mean, 0, 1e-5);
  EXPECT_NEAR(train.std, 1, 1e-5);
  const std::vector<unsigned char> raw = IdxTrainPixels();
  for (size_t i = 0; i < raw.size(); ++i) {
    EXPECT_NEAR(data->train.pixels[i], (raw[i] / 255.0 - expected.mean) / expected.std, 1e-5);
  }
  EXPECT_NEAR(data->test.pixels[0], (200 / 255.0 - expected.mean) / expected.std, 1e-5);
}

TEST_F(IdxTest, TrainLimitNarrowsTheStatsButNotTheClasses) {
  WriteIdxDir();
  v1::DataSpec d = DirSpec();
  d.set_train_limit(2);  // labels {0, 1}; the file still has 5 classes
  d.set_test_limit(1);
  auto data = LoadDataset(d);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->train.count, 2);
  EXPECT_EQ(data->test.count, 1);
  EXPECT_EQ(data->classes, 5);
  std::vector<unsigned char> first_two = IdxTrainPixels();
  first_two.resize(2 * kRows * kCols);
  EXPECT_NEAR(data->normalisation.mean, Stats(first_two).mean, 1e-6);
}

TEST_F(IdxTest, ExplicitFilesResolveAgainstThePath) {
  Write("a.gz", Gzipped(ImageFile(kTrainCount, kRows, kCols, IdxTrainPixels())));
  Write("b", LabelFile(kTrainCount, {0, 1, 4, 2}));
  Write("c", ImageFile(1, kRows, kCols, std::vector<unsigned char>(15, 1)));
  const std::string d_abs = Write("d", LabelFile(1, {2}));
  v1::DataSpec d;
  d.set_type("idx");
  d.set_path(dir_);
  d.set_train_images("a.gz");
  d.set_train_labels("b");
  d.set_test_images("c");
  d.set_test_labels(d_abs);  // absolute: taken as is
  const IdxFiles files = ResolveIdxFiles(d);
  EXPECT_EQ(files.train_images.path, dir_ + "/a.gz");
  EXPECT_EQ(files.train_images.field, "data.train_images");
  EXPECT_EQ(files.test_labels.path, d_abs);
  auto data = LoadDataset(d);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->classes, 5);
  EXPECT_EQ(data->test.labels, (std::vector<int64_t>{2}));
}

TEST_F(IdxTest, MnistTypeKeepsMnistsFixedNormalisation) {
  WriteValidDir();
  v1::DataSpec d = DirSpec();
  d.set_type("mnist");
  auto data = LoadDataset(d);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->classes, 10);
  EXPECT_FLOAT_EQ(data->normalisation.mean, 0.1307f);
  EXPECT_FLOAT_EQ(data->normalisation.std, 0.3081f);
  for (size_t i = 0; i < kPixels.size(); ++i) {
    EXPECT_NEAR(data->train.pixels[i], Normalised(kPixels[i]), 1e-6) << i;
  }
  // The same files as "idx": 10 classes too (max label 9), own statistics.
  auto idx = LoadDataset(DirSpec());
  ASSERT_TRUE(idx.ok()) << idx.status();
  EXPECT_EQ(idx->classes, 10);
  EXPECT_NE(idx->normalisation.mean, 0.1307f);
}

// Each fault, written over one file of a valid directory, gives an error
// that names the file and the fault, from the loader and (except truncated
// pixels, which it does not read) from the submit-time check.
TEST_F(IdxTest, EachFaultNamesTheFile) {
  struct Fault {
    const char* file;
    std::vector<unsigned char> bytes;
    const char* says;
    bool submit_sees_it;
  };
  const std::vector<unsigned char> pixels = IdxTrainPixels();
  std::vector<unsigned char> cut_gz = Gzipped(LabelFile(kTrainCount, {0, 1, 4, 2}));
  cut_gz.resize(cut_gz.size() - 12);
  const std::vector<Fault> faults = {
      {kMnistTrainImages, LabelFile(kTrainCount, {0, 1, 4, 2}), "magic", true},
      {kMnistTestLabels, ImageFile(2, kRows, kCols, std::vector<unsigned char>(30, 0)), "magic",
       true},
      {kMnistTrainImages, ImageFile(kTrainCount, kRows, kCols, {pixels.begin(), pixels.end() - 1}),
       "truncated", false},
      {kMnistTrainLabels, LabelFile(kTrainCount, {0, 1, 4}), "truncated", true},
      {kMnistTestLabels, LabelFile(1, {3}), "2 images", true},
      {kMnistTestLabels, LabelFile(2, {3, 7}), "label 7 at index 1", true},
      {kMnistTestImages, ImageFile(2, kCols, kRows, std::vector<unsigned char>(30, 0)), "3x5",
       true},
      {kMnistTrainLabels, cut_gz, "corrupt gzip", true},
      {kMnistTrainImages, {0, 0, 8}, "truncated idx header", true},
  };
  for (const Fault& f : faults) {
    SCOPED_TRACE(std::string(f.file) + ": " + f.says);
    for (const auto& file : files_) std::remove(file.c_str());
    files_.clear();
    WriteIdxDir();
    std::remove((dir_ + "/" + f.file + ".gz").c_str());
    const std::string path = Write(f.file, f.bytes);
    auto data = LoadDataset(DirSpec());
    EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument) << data.status();
    EXPECT_THAT(std::string(data.status().message()),
                AllOf(HasSubstr("data.path: "), HasSubstr(f.says), HasSubstr(f.file)));
    absl::Status st = CheckDataset(Job({kRows * kCols, 8, 5}));
    if (f.submit_sees_it) {
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      EXPECT_THAT(std::string(st.message()), AllOf(HasSubstr(f.says), HasSubstr(f.file)));
    } else {
      EXPECT_TRUE(st.ok()) << st;
    }
  }
}

TEST_F(IdxTest, MissingFilesAreNotFoundNamingFieldAndPath) {
  v1::DataSpec d = DirSpec();
  auto data = LoadDataset(d);
  EXPECT_EQ(data.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(data.status().message()),
              AllOf(HasSubstr("data.path"), HasSubstr(dir_ + "/" + kMnistTrainLabels)));
  absl::Status st = CheckDataset(Job({15, 5}));
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(st.message()), AllOf(HasSubstr("data.path"), HasSubstr(dir_)));

  WriteIdxDir();
  d.set_train_images(kMnistTrainImages + std::string(".gz"));
  d.set_train_labels(kMnistTrainLabels + std::string(".gz"));
  d.set_test_images(kMnistTestImages);
  d.set_test_labels("no-such-labels");
  data = LoadDataset(d);
  EXPECT_EQ(data.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(data.status().message()),
              AllOf(HasSubstr("data.test_labels: "), HasSubstr(dir_ + "/no-such-labels")));
}

TEST_F(IdxTest, SubmitCheckRefusesAModelThatDoesNotFitTheData) {
  WriteIdxDir();
  EXPECT_TRUE(CheckDataset(Job({15, 8, 5})).ok()) << CheckDataset(Job({15, 8, 5}));
  EXPECT_TRUE(CheckDataset(Job({15, 8, 12})).ok()) << "more outputs than classes is fine";

  absl::Status st = CheckDataset(Job({784, 8, 5}));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()),
              AllOf(HasSubstr("model.layers[0]"), HasSubstr("784"), HasSubstr("3x5 = 15")));

  st = CheckDataset(Job({15, 8, 4}));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()),
              AllOf(HasSubstr("model.layers[2]"), HasSubstr("is 4"), HasSubstr("5 classes"),
                    HasSubstr(kMnistTrainLabels)));
}

TEST_F(IdxTest, SubmitCheckOfMnistNeedsDigitLabels) {
  WriteValidDir();
  v1::JobSpec job = Job({4, 10});
  job.mutable_data()->set_type("mnist");
  EXPECT_TRUE(CheckDataset(job).ok()) << CheckDataset(job);
  Write(kMnistTestLabels, LabelFile(1, {11}));
  absl::Status st = CheckDataset(job);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()),
              AllOf(HasSubstr(kMnistTestLabels), HasSubstr("label 11"), HasSubstr("0..9")));
}

}  // namespace
}  // namespace pipemare
