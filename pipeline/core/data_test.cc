#include "pipeline/core/data.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "pipeline/core/mnist.h"

namespace pipemare {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

// The plain-text corpus that CI installs (Debian package fortunes, pulled in
// by scripts/dev.sh deps): ASCII fortune cookies separated by "%" lines.
constexpr const char* kFortunesCorpus = "/usr/share/games/fortunes/cookie";

void ExpectInvalid(const absl::Status& st, const std::vector<std::string>& parts) {
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  for (const auto& p : parts) EXPECT_THAT(std::string(st.message()), HasSubstr(p));
}

// The pixel byte of channel c, position k (0..1023) in record r of a
// patterned file: distinct per record, channel and position.
unsigned char Pixel(int r, int c, int k) { return static_cast<unsigned char>(r * 7 + c * 50 + k); }

// `records` CIFAR records: labels[r % labels.size()], pixels Pixel(first + r, ...).
std::vector<unsigned char> CifarBytes(int records, const std::vector<unsigned char>& labels,
                                      int first = 0) {
  std::vector<unsigned char> out;
  for (int r = 0; r < records; ++r) {
    out.push_back(labels[r % labels.size()]);
    for (int c = 0; c < 3; ++c) {
      for (int k = 0; k < 1024; ++k) out.push_back(Pixel(first + r, c, k));
    }
  }
  return out;
}

class DataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = testing::TempDir() + "/data_test_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    ASSERT_NE(mkdtemp(buf.data()), nullptr);
    dir_ = buf.data();
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Write(const std::string& name, const std::vector<unsigned char>& bytes) {
    const std::string path = dir_ + "/" + name;
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    return path;
  }

  // data_batch_1.bin (12 records, labels 0..9 cycling), data_batch_3.bin (8
  // records, label 3 then 4...) and test_batch.bin (5 records, labels 9, 0..).
  void WriteCifarDir() {
    Write("data_batch_1.bin", CifarBytes(12, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
    Write("data_batch_3.bin", CifarBytes(8, {3, 4}, 12));
    Write("test_batch.bin", CifarBytes(5, {9, 0, 1, 2, 3}, 100));
  }
  std::vector<int64_t> CifarTrainLabels() const {
    std::vector<int64_t> l;
    for (int r = 0; r < 12; ++r) l.push_back(r % 10);
    for (int r = 0; r < 8; ++r) l.push_back(r % 2 == 0 ? 3 : 4);
    return l;
  }

  v1::DataSpec Cifar() const {
    v1::DataSpec d;
    d.set_type("cifar");
    d.set_path(dir_);
    return d;
  }

  std::string dir_;
};

// ---------------------------------------------------------------------------
// cifar

TEST_F(DataTest, CifarFindsTheDefaultFilesThatArePresent) {
  WriteCifarDir();
  v1::DataSpec d = Cifar();
  auto info = InspectData(d);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->task, Task::kClassification);
  EXPECT_EQ(info->input_shape, (std::vector<int64_t>{3, 32, 32}));
  EXPECT_FALSE(info->token_input());
  EXPECT_EQ(info->classes, 10);
  EXPECT_EQ(info->train_count, 20);
  EXPECT_EQ(info->test_count, 5);
  EXPECT_EQ(info->description, "cifar: 20 train, 5 test 3x32x32 images, 10 classes");

  d.set_normalize(false);
  auto data = LoadData(d);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->info.description, info->description);
  EXPECT_EQ(data->normalisation, "none (pixel / 255)");
  const Examples& train = data->train;
  EXPECT_EQ(train.count, 20);
  EXPECT_EQ(train.input_shape, (std::vector<int64_t>{3, 32, 32}));
  EXPECT_TRUE(train.target_shape.empty());
  EXPECT_FALSE(train.token_input());
  EXPECT_EQ(train.InputSize(), 3072);
  EXPECT_EQ(train.TargetSize(), 1);
  EXPECT_TRUE(train.tokens.empty());
  ASSERT_EQ(train.inputs.size(), 20u * 3072);
  EXPECT_EQ(train.targets, CifarTrainLabels());
  // Channel planes in the file's order (R, G, B), records in file order.
  for (int r : {0, 11, 12, 19}) {
    for (int c = 0; c < 3; ++c) {
      for (int k : {0, 1, 31, 32, 1023}) {
        EXPECT_FLOAT_EQ(train.inputs[r * 3072 + c * 1024 + k], Pixel(r, c, k) / 255.0f)
            << r << " " << c << " " << k;
      }
    }
  }
  EXPECT_EQ(data->test.count, 5);
  EXPECT_EQ(data->test.targets, (std::vector<int64_t>{9, 0, 1, 2, 3}));
  EXPECT_FLOAT_EQ(data->test.inputs[4 * 3072 + 2 * 1024 + 7], Pixel(104, 2, 7) / 255.0f);
}

TEST_F(DataTest, CifarNormalisesEachChannelWithTheTrainingPixels) {
  // Record 0: R all 0, G all 51, B 0 then 255 alternating; record 1: R all
  // 255, G all 51, B the same. R: mean 0.5, std 0.5; G: constant 0.2, std 1;
  // B: mean 0.5, std 0.5.
  std::vector<unsigned char> bytes;
  for (int r = 0; r < 2; ++r) {
    bytes.push_back(static_cast<unsigned char>(r));
    for (int k = 0; k < 1024; ++k) bytes.push_back(r == 0 ? 0 : 255);
    for (int k = 0; k < 1024; ++k) bytes.push_back(51);
    for (int k = 0; k < 1024; ++k) bytes.push_back(k % 2 == 0 ? 0 : 255);
  }
  Write("data_batch_1.bin", bytes);
  // Test: one record, every pixel 102 (0.4).
  std::vector<unsigned char> test(kCifarRecordBytes, 102);
  test[0] = 1;
  Write("test_batch.bin", test);
  auto data = LoadData(Cifar());
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->normalisation,
            "per-channel mean [0.5, 0.2, 0.5] std [0.5, 1, 0.5] (training pixels)");
  const auto& in = data->train.inputs;
  EXPECT_FLOAT_EQ(in[0], -1);               // record 0, R
  EXPECT_FLOAT_EQ(in[3072 + 5], 1);         // record 1, R
  EXPECT_NEAR(in[1024 + 9], 0, 1e-6);       // G
  EXPECT_FLOAT_EQ(in[2048], -1);            // B, k = 0
  EXPECT_FLOAT_EQ(in[3072 + 2048 + 1], 1);  // B, k = 1
  const auto& t = data->test.inputs;
  EXPECT_NEAR(t[0], (0.4 - 0.5) / 0.5, 1e-6);
  EXPECT_NEAR(t[1024], 0.4 - 0.2, 1e-6);
  EXPECT_NEAR(t[2048 + 3], (0.4 - 0.5) / 0.5, 1e-6);
}

TEST_F(DataTest, CifarLimitsKeepTheFirstRecordsAcrossFilesAndNormaliseWithThem) {
  WriteCifarDir();
  v1::DataSpec d = Cifar();
  d.set_train_limit(15);  // all of data_batch_1.bin, 3 of data_batch_3.bin
  d.set_test_limit(2);
  auto info = InspectData(d);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->train_count, 15);
  EXPECT_EQ(info->test_count, 2);
  EXPECT_EQ(info->classes, 10) << "classes count every training record, not only those in use";
  auto data = LoadData(d);
  ASSERT_TRUE(data.ok()) << data.status();
  std::vector<int64_t> labels = CifarTrainLabels();
  labels.resize(15);
  EXPECT_EQ(data->train.targets, labels);
  EXPECT_EQ(data->test.targets, (std::vector<int64_t>{9, 0}));
  ASSERT_EQ(data->train.inputs.size(), 15u * 3072);
  ASSERT_EQ(data->test.inputs.size(), 2u * 3072);
  // Each channel's mean and std over the 15 records in use.
  for (int c = 0; c < 3; ++c) {
    double sum = 0, squares = 0;
    for (int r = 0; r < 15; ++r) {
      for (int k = 0; k < 1024; ++k) {
        const double p = Pixel(r, c, k) / 255.0;
        sum += p, squares += p * p;
      }
    }
    const double mean = sum / (15 * 1024);
    const double std = std::sqrt(squares / (15 * 1024) - mean * mean);
    for (int r : {0, 14}) {
      EXPECT_NEAR(data->train.inputs[r * 3072 + c * 1024 + 77],
                  (Pixel(r, c, 77) / 255.0 - mean) / std, 1e-4);
    }
    EXPECT_NEAR(data->test.inputs[1 * 3072 + c * 1024 + 5], (Pixel(101, c, 5) / 255.0 - mean) / std,
                1e-4);
    // The normalised training channel has mean 0 and std 1.
    double nsum = 0, nsquares = 0;
    for (int r = 0; r < 15; ++r) {
      for (int k = 0; k < 1024; ++k) {
        const double v = data->train.inputs[r * 3072 + c * 1024 + k];
        nsum += v, nsquares += v * v;
      }
    }
    EXPECT_NEAR(nsum / (15 * 1024), 0, 1e-4);
    EXPECT_NEAR(nsquares / (15 * 1024), 1, 1e-3);
  }
  EXPECT_THAT(data->normalisation, HasSubstr("per-channel mean ["));
}

TEST_F(DataTest, CifarExplicitFilesResolveAgainstThePath) {
  Write("a/one.bin", CifarBytes(3, {0, 1, 2}));
  const std::string abs = Write("b/two.bin", CifarBytes(2, {5, 1}, 3));
  Write("a/t.bin", CifarBytes(4, {5, 4, 3, 2}, 9));
  v1::DataSpec d;
  d.set_type("cifar");
  d.set_path(dir_ + "/a");
  d.add_train_files("one.bin");
  d.add_train_files(abs);
  d.add_test_files("t.bin");
  auto data = LoadData(d);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->info.classes, 6);
  EXPECT_EQ(data->train.targets, (std::vector<int64_t>{0, 1, 2, 5, 1}));
  EXPECT_EQ(data->test.targets, (std::vector<int64_t>{5, 4, 3, 2}));

  // Absolute lists need no path.
  v1::DataSpec no_path;
  no_path.set_type("cifar");
  no_path.add_train_files(abs);
  no_path.add_test_files(dir_ + "/a/t.bin");
  auto info = InspectData(no_path);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->train_count, 2);
  EXPECT_EQ(info->classes, 6);

  // One list given, the other from the standard name in data.path.
  Write("a/test_batch.bin", CifarBytes(1, {2}));
  v1::DataSpec mixed;
  mixed.set_type("cifar");
  mixed.set_path(dir_ + "/a");
  mixed.add_train_files("one.bin");
  info = InspectData(mixed);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->test_count, 1);
  EXPECT_EQ(info->classes, 3);
}

TEST_F(DataTest, CifarTruncatedFileIsRefusedAtInspectWithItsSize) {
  WriteCifarDir();
  std::vector<unsigned char> bytes = CifarBytes(2, {1});
  bytes.resize(bytes.size() - 100);  // 6046 bytes
  const std::string path = Write("data_batch_2.bin", bytes);
  for (const absl::Status& st : {InspectData(Cifar()).status(), LoadData(Cifar()).status()}) {
    ExpectInvalid(st,
                  {"data.path: ", path, "truncated or not a CIFAR-10 binary batch", "6046 bytes",
                   "multiple of 3073", "3073 for 1 record or 6146 for 2 records"});
    EXPECT_TRUE(absl::StartsWith(st.message(), "data.path: ")) << st;
  }

  v1::DataSpec d = Cifar();
  d.add_train_files("data_batch_1.bin");
  d.add_train_files("data_batch_2.bin");
  ExpectInvalid(InspectData(d).status(), {"data.train_files[1]: ", path, "6046 bytes"});

  std::vector<unsigned char> tiny(100, 0);
  Write("data_batch_2.bin", tiny);
  ExpectInvalid(InspectData(Cifar()).status(), {"100 bytes", "3073 for one record"});
}

TEST_F(DataTest, CifarHundredFilesAreNamed) {
  // CIFAR-100's records carry 2 label bytes: 3074 bytes each.
  Write("data_batch_1.bin", std::vector<unsigned char>(3 * 3074, 0));
  Write("test_batch.bin", CifarBytes(1, {0}));
  ExpectInvalid(InspectData(Cifar()).status(), {"9222 bytes", "CIFAR-100"});
}

TEST_F(DataTest, CifarMissingAndEmptyFiles) {
  // No directory.
  v1::DataSpec d = Cifar();
  d.set_path(dir_ + "/nowhere");
  ExpectInvalid(InspectData(d).status(),
                {"data.path: ", dir_ + "/nowhere", "no such directory", "data_batch_1.bin"});
  // No path, no lists.
  d.clear_path();
  ExpectInvalid(InspectData(d).status(), {"data.path: required", "data.train_files"});
  // A directory without training batches; the common nesting is pointed out.
  std::filesystem::create_directories(dir_ + "/cifar-10-batches-bin");
  ExpectInvalid(InspectData(Cifar()).status(),
                {"data.path: ", "holds none of data_batch_1.bin", dir_ + "/cifar-10-batches-bin"});
  // Training batches but no test batch.
  Write("data_batch_1.bin", CifarBytes(2, {0, 1}));
  ExpectInvalid(LoadData(Cifar()).status(),
                {"data.path: ", dir_ + "/test_batch.bin", "file not found"});
  // A listed file that does not exist.
  d = Cifar();
  d.add_test_files("missing.bin");
  ExpectInvalid(InspectData(d).status(),
                {"data.test_files[0]: ", dir_ + "/missing.bin", "file not found"});
  // An empty file.
  Write("test_batch.bin", {});
  ExpectInvalid(InspectData(Cifar()).status(),
                {"data.path: ", dir_ + "/test_batch.bin", "empty file (0 bytes)"});
  // A directory where a file should be.
  d = Cifar();
  d.add_test_files("cifar-10-batches-bin");
  ExpectInvalid(InspectData(d).status(), {"data.test_files[0]: ", "is a directory"});
  // An empty entry in a list.
  d = Cifar();
  d.add_train_files("data_batch_1.bin");
  d.add_train_files("");
  ExpectInvalid(InspectData(d).status(), {"data.train_files[1]: empty"});
}

TEST_F(DataTest, CifarTestLabelsMustBeTrainingClasses) {
  Write("data_batch_1.bin", CifarBytes(4, {0, 1, 2, 3}));
  const std::string test = Write("test_batch.bin", CifarBytes(3, {1, 2, 7}));
  for (const absl::Status& st : {InspectData(Cifar()).status(), LoadData(Cifar()).status()}) {
    ExpectInvalid(st, {"data.path: ", test, "label 7 at record 2", "4 classes", "0..3"});
  }
  // Beyond data.test_limit the label is not used.
  v1::DataSpec d = Cifar();
  d.set_test_limit(2);
  auto data = LoadData(d);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->test.targets, (std::vector<int64_t>{1, 2}));
}

// ---------------------------------------------------------------------------
// text

std::vector<unsigned char> CorpusBytes(int n) {
  std::vector<unsigned char> b(n);
  for (int i = 0; i < n; ++i) b[i] = static_cast<unsigned char>(i * 37 + 11);  // every byte value
  return b;
}

TEST_F(DataTest, TextWindowsPredictTheNextByte) {
  const std::vector<unsigned char> bytes = CorpusBytes(1000);
  const std::string path = Write("corpus.txt", bytes);
  v1::DataSpec d;
  d.set_type("text");
  d.set_path(path);
  d.set_context(16);
  auto info = InspectData(d);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->task, Task::kLanguageModel);
  EXPECT_TRUE(info->token_input());
  EXPECT_EQ(info->input_shape, (std::vector<int64_t>{16}));
  EXPECT_EQ(info->classes, 256);
  // Test split: the last 100 bytes; train: the first 900.
  EXPECT_EQ(info->train_count, (900 - 1) / 16);  // 56
  EXPECT_EQ(info->test_count, (100 - 1) / 16);   // 6
  EXPECT_EQ(info->description, absl::StrCat("text: ", path,
                                            ", 1000 bytes: 56 train, 6 test windows of 16 "
                                            "bytes, 256-byte vocabulary"));

  auto data = LoadData(d);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->normalisation, "");
  EXPECT_EQ(data->info.description, info->description);
  for (const auto& [split, first, count] :
       {std::tuple<const Examples*, int, int>{&data->train, 0, 56}, {&data->test, 900, 6}}) {
    const Examples& e = *split;
    EXPECT_EQ(e.count, count);
    EXPECT_TRUE(e.token_input());
    EXPECT_EQ(e.input_shape, (std::vector<int64_t>{16}));
    EXPECT_EQ(e.target_shape, (std::vector<int64_t>{16}));
    EXPECT_EQ(e.InputSize(), 16);
    EXPECT_EQ(e.TargetSize(), 16);
    EXPECT_TRUE(e.inputs.empty());
    ASSERT_EQ(e.tokens.size(), count * 16u);
    ASSERT_EQ(e.targets.size(), count * 16u);
    for (int i = 0; i < count; ++i) {
      for (int t = 0; t < 16; ++t) {
        ASSERT_EQ(e.tokens[i * 16 + t], bytes[first + i * 16 + t]) << first << " " << i << " " << t;
        ASSERT_EQ(e.targets[i * 16 + t], bytes[first + i * 16 + t + 1]) << i << " " << t;
      }
    }
  }
  // The last training target is byte 896, inside the training split.
  EXPECT_EQ(data->train.targets.back(), bytes[56 * 16]);
  EXPECT_EQ(data->test.targets.back(), bytes[900 + 6 * 16]);
}

TEST_F(DataTest, TextDefaultsSplitsAndLimits) {
  const std::string path = Write("corpus.txt", CorpusBytes(1000));
  v1::DataSpec d;
  d.set_type("text");
  d.set_path(path);
  auto info = InspectData(d);  // context 64, fraction 0.1
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->input_shape, (std::vector<int64_t>{64}));
  EXPECT_EQ(info->train_count, 899 / 64);  // 14
  EXPECT_EQ(info->test_count, 99 / 64);    // 1

  d.set_validation_fraction(0.25);  // 750 / 250 bytes
  d.set_context(10);
  info = InspectData(d);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->train_count, 74);
  EXPECT_EQ(info->test_count, 24);

  d.set_train_limit(5);
  d.set_test_limit(30);  // above the count: all
  auto data = LoadData(d);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->train.count, 5);
  EXPECT_EQ(data->train.tokens.size(), 50u);
  EXPECT_EQ(data->test.count, 24);
  EXPECT_EQ(data->test.tokens[0], CorpusBytes(1000)[750]);

  // A context of 1: every byte but the last of a split is an example.
  d.clear_train_limit();
  d.set_context(1);
  info = InspectData(d);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->train_count, 749);
  EXPECT_EQ(info->test_count, 30);  // test_limit
}

TEST_F(DataTest, TextShorterThanOneContextIsRefusedWithTheFix) {
  const std::string path = Write("short.txt", CorpusBytes(500));
  v1::DataSpec d;
  d.set_type("text");
  d.set_path(path);
  // Test split: the last 50 bytes; a context of 64 needs 65.
  for (const absl::Status& st : {InspectData(d).status(), LoadData(d).status()}) {
    ExpectInvalid(st, {"data.path: ", path, "corpus too short", "test split", "500 bytes",
                       "holds 50 bytes", "data.context 64 needs at least 65",
                       "data.context 49 or less", "larger data.validation_fraction"});
  }
  // The training split too short: the first 50 bytes.
  d.set_validation_fraction(0.9);
  d.set_context(50);
  ExpectInvalid(InspectData(d).status(),
                {"data.path: ", "training split", "holds 50 bytes", "needs at least 51",
                 "data.context 49 or less", "smaller data.validation_fraction"});
  d.set_context(49);
  EXPECT_TRUE(InspectData(d).ok()) << InspectData(d).status();
  // A split of one byte cannot be fixed by the context.
  const std::string one = Write("tiny.txt", {'a', 'b'});
  d.set_path(one);
  d.set_validation_fraction(0.5);
  d.set_context(1);
  const absl::Status st = InspectData(d).status();
  ExpectInvalid(st, {"holds 1 byte,", "needs at least 2", "a corpus longer than 2 bytes"});
  EXPECT_THAT(std::string(st.message()), Not(HasSubstr("or less")));
}

TEST_F(DataTest, TextBadFilesAndFields) {
  v1::DataSpec d;
  d.set_type("text");
  ExpectInvalid(InspectData(d).status(), {"data.path: required", "corpus"});
  d.set_path(dir_ + "/none.txt");
  ExpectInvalid(LoadData(d).status(), {"data.path: ", dir_ + "/none.txt", "file not found"});
  d.set_path(dir_);
  ExpectInvalid(InspectData(d).status(), {"data.path: ", "is a directory", "corpus"});
  d.set_path(Write("empty.txt", {}));
  ExpectInvalid(LoadData(d).status(), {"data.path: ", "empty.txt", "empty file (0 bytes)"});
  d.set_path(Write("c.txt", CorpusBytes(2000)));
  d.set_context(-1);
  ExpectInvalid(InspectData(d).status(), {"data.context: ", "1..65536"});
  d.set_context(65537);
  ExpectInvalid(LoadData(d).status(), {"data.context: ", "1..65536"});
  d.set_context(8);
  d.set_validation_fraction(1);
  ExpectInvalid(InspectData(d).status(), {"data.validation_fraction: ", "(0, 1)"});
  d.set_validation_fraction(-0.1);
  ExpectInvalid(InspectData(d).status(), {"data.validation_fraction: ", "(0, 1)"});
}

// The corpus CI installs: a real file, end to end.
TEST_F(DataTest, TextLoadsTheFortunesCorpus) {
  std::ifstream in(kFortunesCorpus, std::ios::binary);
  ASSERT_TRUE(in) << kFortunesCorpus
                  << " is missing: install Debian's fortunes package (scripts/dev.sh deps)";
  const std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)),
                                         std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 100000u);
  v1::DataSpec d;
  d.set_type("text");
  d.set_path(kFortunesCorpus);
  auto data = LoadData(d);
  ASSERT_TRUE(data.ok()) << data.status();
  const int64_t n = bytes.size();
  const int64_t test_bytes = std::llround(n * 0.1), train_bytes = n - test_bytes;
  EXPECT_EQ(data->train.count, (train_bytes - 1) / 64);
  EXPECT_EQ(data->test.count, (test_bytes - 1) / 64);
  EXPECT_EQ(data->info.train_count, data->train.count);
  EXPECT_EQ(data->info.classes, 256);
  for (int64_t i = 0; i < data->train.count * 64; ++i) {
    ASSERT_EQ(data->train.tokens[i], bytes[i]) << i;
    ASSERT_EQ(data->train.targets[i], bytes[i + 1]) << i;
    ASSERT_LT(data->train.tokens[i], 128) << "ASCII text";
  }
  for (int64_t i = 0; i < data->test.count * 64; ++i) {
    ASSERT_EQ(data->test.tokens[i], bytes[train_bytes + i]) << i;
    ASSERT_EQ(data->test.targets[i], bytes[train_bytes + i + 1]) << i;
  }
}

// ---------------------------------------------------------------------------
// idx and mnist through the same interface

void PutBigEndian(std::vector<unsigned char>& out, uint32_t v) {
  for (int s : {24, 16, 8, 0}) out.push_back(static_cast<unsigned char>(v >> s));
}
std::vector<unsigned char> IdxImages(uint32_t count, uint32_t rows, uint32_t cols,
                                     const std::vector<unsigned char>& pixels) {
  std::vector<unsigned char> out;
  for (uint32_t v : {0x00000803u, count, rows, cols}) PutBigEndian(out, v);
  out.insert(out.end(), pixels.begin(), pixels.end());
  return out;
}
std::vector<unsigned char> IdxLabels(const std::vector<unsigned char>& labels) {
  std::vector<unsigned char> out;
  for (uint32_t v : {0x00000801u, static_cast<uint32_t>(labels.size())}) PutBigEndian(out, v);
  out.insert(out.end(), labels.begin(), labels.end());
  return out;
}

TEST_F(DataTest, IdxAndMnistThroughTheGenericInterface) {
  Write(kMnistTrainImages, IdxImages(3, 2, 2, {0, 255, 0, 255, 0, 255, 0, 255, 0, 255, 0, 255}));
  Write(kMnistTrainLabels, IdxLabels({7, 0, 9}));
  Write(kMnistTestImages, IdxImages(1, 2, 2, {51, 51, 51, 51}));
  Write(kMnistTestLabels, IdxLabels({3}));
  v1::DataSpec d;
  d.set_type("idx");
  d.set_path(dir_);
  d.set_test_limit(1);
  auto info = InspectData(d);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->input_shape, (std::vector<int64_t>{1, 2, 2}));
  EXPECT_EQ(info->classes, 10);
  EXPECT_EQ(info->train_count, 3);
  EXPECT_EQ(info->test_count, 1);
  EXPECT_EQ(info->description, "idx: 3 train, 1 test 1x2x2 images, 10 classes");

  auto data = LoadData(d);  // mean 0.5, std 0.5
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->normalisation, "mean 0.5 std 0.5 (training pixels)");
  EXPECT_EQ(data->train.input_shape, (std::vector<int64_t>{1, 2, 2}));
  EXPECT_TRUE(data->train.target_shape.empty());
  EXPECT_EQ(data->train.targets, (std::vector<int64_t>{7, 0, 9}));
  EXPECT_FLOAT_EQ(data->train.inputs[0], -1);
  EXPECT_FLOAT_EQ(data->train.inputs[1], 1);
  EXPECT_NEAR(data->test.inputs[0], (0.2 - 0.5) / 0.5, 1e-6);

  d.set_normalize(false);
  data = LoadData(d);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->normalisation, "none (pixel / 255)");
  EXPECT_FLOAT_EQ(data->train.inputs[1], 1);
  EXPECT_NEAR(data->test.inputs[0], 0.2, 1e-6);

  d.set_type("mnist");
  d.clear_normalize();
  data = LoadData(d);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->normalisation, "mean 0.1307 std 0.3081 (MNIST's)");
  EXPECT_EQ(data->info.description, "mnist: 3 train, 1 test 1x2x2 images, 10 classes");
  EXPECT_NEAR(data->train.inputs[1], (1 - 0.1307) / 0.3081, 1e-5);

  // Errors keep the idx loader's wording.
  std::filesystem::remove(dir_ + "/" + kMnistTestLabels);
  EXPECT_THAT(std::string(InspectData(d).status().message()),
              AllOf(HasSubstr("data.path"), HasSubstr(kMnistTestLabels)));
}

TEST(DataTypeTest, UnknownTypeIsRefused) {
  v1::DataSpec d;
  ExpectInvalid(InspectData(d).status(), {"data.type: required", "idx, mnist, cifar, text"});
  d.set_type("imagenet");
  ExpectInvalid(LoadData(d).status(), {"data.type: 'imagenet' is not allowed"});
}

}  // namespace
}  // namespace pipemare

namespace pipemare {
namespace {

TEST_F(DataTest, TheManifestNamesEachFileAndCatchesACopyThatDiffers) {
  std::vector<unsigned char> text;
  for (int i = 0; i < 4000; ++i) text.push_back(static_cast<unsigned char>('a' + i % 26));
  const std::string corpus = Write("corpus.txt", text);
  v1::DataSpec d;
  d.set_type("text");
  d.set_path(corpus);
  d.set_context(16);
  auto manifest = ManifestOfData(d);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  ASSERT_EQ(manifest->size(), 1u);
  EXPECT_EQ((*manifest)[0].path(), corpus);
  EXPECT_EQ((*manifest)[0].size(), 4000);
  EXPECT_EQ((*manifest)[0].sha256().size(), 64u);
  google::protobuf::RepeatedPtrField<v1::DataFile> want(manifest->begin(), manifest->end());
  EXPECT_TRUE(CheckDataManifest(d, want).ok());
  // The same size, one byte changed: the hash tells.
  text[100] = '#';
  Write("corpus.txt", text);
  ExpectInvalid(CheckDataManifest(d, want),
                {"data.path", corpus, "differs from the coordinator's", "SHA-256"});
  // Shorter: the size tells, before reading.
  text.resize(3000);
  Write("corpus.txt", text);
  ExpectInvalid(CheckDataManifest(d, want), {"data.path", "3000 bytes here, 4000 bytes"});
  std::filesystem::remove(corpus);
  ExpectInvalid(CheckDataManifest(d, want), {"data.path", "file not found"});
}

TEST_F(DataTest, ALaterRunRefusesDataThatChangedSinceTheFirst) {
  std::vector<unsigned char> text(4000, 'a');
  const std::string corpus = Write("corpus.txt", text);
  v1::DataSpec d;
  d.set_type("text");
  d.set_path(corpus);
  auto first = ManifestOfData(d);
  ASSERT_TRUE(first.ok()) << first.status();
  const google::protobuf::RepeatedPtrField<v1::DataFile> kept(first->begin(), first->end());
  EXPECT_TRUE(CheckDataUnchanged(*ManifestOfData(d), kept).ok());
  text[7] = 'b';
  Write("corpus.txt", text);
  ExpectInvalid(CheckDataUnchanged(*ManifestOfData(d), kept),
                {"data.path", corpus, "changed since the job started", "4000 bytes, SHA-256",
                 "put back the files the job started with"});
  ExpectInvalid(CheckDataUnchanged({}, kept), {"data: 0 files now, 1 when the job started"});
}

TEST_F(DataTest, GatherTakesExamplesByTheOrderSideBySide) {
  Examples e;
  e.count = 4;
  e.input_shape = {1, 1, 2};
  e.inputs = {0, 1, 10, 11, 20, 21, 30, 31};
  e.targets = {0, 1, 2, 3};
  const Batch in = GatherInputs(e, {3, 1, 0, 2}, 1, 2);
  EXPECT_EQ(in.shape, (std::vector<int64_t>{2, 1, 1, 2}));
  EXPECT_EQ(in.floats, (std::vector<float>{10, 11, 0, 1}));
  const Batch t = GatherTargets(e, {}, 2, 2);
  EXPECT_EQ(t.shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(t.ints, (std::vector<int64_t>{2, 3}));
}

}  // namespace
}  // namespace pipemare
