#include "pipeline/model/model.h"

#include <torch/script.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "pipeline/core/file_access.h"
#include "pipeline/core/job_spec.h"
#include "pipeline/core/mnist.h"
#include "pipeline/core/partition.h"
#include "pipeline/core/settings.h"

namespace pipemare {
namespace {

absl::Status Bad(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

// LibTorch's message without its C++ backtrace, first line only.
std::string TorchMessage(const std::exception& e) {
  std::string s;
  if (auto* c10 = dynamic_cast<const c10::Error*>(&e)) {
    s = c10->what_without_backtrace();
  } else {
    s = e.what();
  }
  const size_t nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

// --- Modules that are not in torch::nn -------------------------------------

// One unit: a chain of layers that a stage runs as a whole.
struct UnitImpl : torch::nn::Module {
  explicit UnitImpl(torch::nn::Sequential layers) : seq(register_module("seq", layers)) {}
  torch::Tensor forward(torch::Tensor x) { return seq->forward(x); }
  torch::nn::Sequential seq;
};
TORCH_MODULE(Unit);

// Token embedding plus optional learned positions.
struct EmbeddingUnitImpl : torch::nn::Module {
  EmbeddingUnitImpl(int64_t vocab, int64_t dim, int64_t context)
      : tokens(register_module("tokens", torch::nn::Embedding(vocab, dim))), context(context) {
    if (context > 0) positions = register_module("positions", torch::nn::Embedding(context, dim));
    torch::NoGradGuard no_grad;
    tokens->weight.normal_(0, 0.02);
    if (positions) positions->weight.normal_(0, 0.02);
  }
  torch::Tensor forward(torch::Tensor x) {
    torch::Tensor h = tokens->forward(x);
    if (positions) {
      const int64_t T = x.size(-1);
      TORCH_CHECK(T <= context, "a context of ", T, " tokens is longer than the embedding's ",
                  context, " positions");
      h = h + positions->forward(torch::arange(T, x.options().dtype(torch::kLong)));
    }
    return h;
  }
  torch::nn::Embedding tokens{nullptr}, positions{nullptr};
  int64_t context;
};
TORCH_MODULE(EmbeddingUnit);

// Pre-LayerNorm decoder block with causal self-attention:
//   x + attn(ln1(x)), then + mlp(ln2(x)), mlp = fc2(gelu(fc1)).
struct TransformerBlockImpl : torch::nn::Module {
  TransformerBlockImpl(int64_t dim, int64_t heads, int64_t hidden, double p)
      : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        qkv(register_module("qkv", torch::nn::Linear(dim, 3 * dim))),
        proj(register_module("proj", torch::nn::Linear(dim, dim))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        fc1(register_module("fc1", torch::nn::Linear(dim, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, dim))),
        drop(register_module("drop", torch::nn::Dropout(p))),
        heads(heads) {}
  torch::Tensor forward(torch::Tensor x) {
    const int64_t B = x.size(0), T = x.size(1), D = x.size(2), H = heads, Dh = D / H;
    auto parts = qkv->forward(ln1->forward(x)).chunk(3, /*dim=*/2);
    auto split = [&](const torch::Tensor& t) { return t.reshape({B, T, H, Dh}).transpose(1, 2); };
    torch::Tensor q = split(parts[0]), k = split(parts[1]), v = split(parts[2]);
    torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(Dh));
    torch::Tensor mask = torch::ones({T, T}, x.options().dtype(torch::kBool)).triu(/*diagonal=*/1);
    scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
    torch::Tensor att = drop->forward(torch::softmax(scores, -1));
    torch::Tensor y = torch::matmul(att, v).transpose(1, 2).reshape({B, T, D});
    x = x + drop->forward(proj->forward(y));
    return x + drop->forward(fc2->forward(torch::gelu(fc1->forward(ln2->forward(x)))));
  }
  torch::nn::LayerNorm ln1{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
  torch::nn::LayerNorm ln2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
  int64_t heads;
};
TORCH_MODULE(TransformerBlock);

// y = shortcut(x) + body(x), then ReLU if `relu_after` (ResNet's block).
// An empty shortcut is the identity.
struct ResidualImpl : torch::nn::Module {
  ResidualImpl(torch::nn::Sequential body, torch::nn::Sequential shortcut, bool relu_after)
      : body(register_module("body", body)), relu_after(relu_after) {
    if (!shortcut->is_empty()) this->shortcut = register_module("shortcut", shortcut);
  }
  torch::Tensor forward(torch::Tensor x) {
    torch::Tensor y = body->forward(x) + (shortcut ? shortcut->forward(x) : x);
    return relu_after ? torch::relu(y) : y;
  }
  torch::nn::Sequential body, shortcut{nullptr};
  bool relu_after;
};
TORCH_MODULE(Residual);

// A top-level child of a TorchScript nn.Sequential. Its parameters and
// buffers are registered here too (same tensors), so the optimizer, T2's
// weight swap and .to() reach the scripted module.
struct ScriptUnitImpl : torch::nn::Module {
  explicit ScriptUnitImpl(torch::jit::Module m) : script(std::move(m)) {
    auto clean = [](std::string n) {
      std::replace(n.begin(), n.end(), '.', '_');
      return n;
    };
    for (const auto& p : script.named_parameters(/*recurse=*/true))
      register_parameter(clean(p.name), p.value);
    for (const auto& b : script.named_buffers(/*recurse=*/true))
      register_buffer(clean(b.name), b.value);
  }
  torch::Tensor forward(torch::Tensor x) { return script.forward({x}).toTensor(); }
  void train(bool on = true) override {
    torch::nn::Module::train(on);
    script.train(on);
  }
  torch::jit::Module script;
};
TORCH_MODULE(ScriptUnit);

// --- Shapes -----------------------------------------------------------------

int64_t Numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// Runs `m` on one zero example of type `in` (eval mode, no grad) and returns
// the output type; INVALID_ARGUMENT "<label>: ..." with both shapes if it
// does not fit.
absl::StatusOr<TensorType> Probe(torch::nn::AnyModule& m, const TensorType& in,
                                 const std::string& label) {
  std::vector<int64_t> shape = {1};
  shape.insert(shape.end(), in.shape.begin(), in.shape.end());
  try {
    torch::NoGradGuard no_grad;
    m.ptr()->eval();
    torch::Tensor x = torch::zeros(shape, in.tokens ? torch::kLong : torch::kFloat);
    torch::Tensor y = m.forward(x);
    m.ptr()->train();
    if (!y.is_floating_point() || y.dim() < 2) {
      return Bad(label,
                 absl::StrCat("gives ", y.dim() < 2 ? "no batch dimension" : "non-float output",
                              " on input ", ShapeString(in),
                              "; a unit must give float [B, ...] activations"));
    }
    return TensorType{std::vector<int64_t>(y.sizes().begin() + 1, y.sizes().end()), false};
  } catch (const std::exception& e) {
    m.ptr()->train();
    return Bad(label,
               absl::StrCat("does not fit its input ", ShapeString(in), ": ", TorchMessage(e)));
  }
}

absl::Status Expect(bool ok, const std::string& label, const TensorType& in,
                    const std::string& wants) {
  if (ok) return absl::OkStatus();
  return Bad(label, absl::StrCat("expects ", wants, " but its input is ", ShapeString(in)));
}

absl::Status ExpectFloat(const std::string& label, const TensorType& in, size_t rank,
                         const std::string& wants) {
  if (in.tokens) {
    return Bad(label, absl::StrCat("expects ", wants, " but its input is ", ShapeString(in),
                                   "; token ids need an embedding first"));
  }
  return Expect(rank == 0 ? !in.shape.empty() : in.shape.size() == rank, label, in, wants);
}

// A declared input size (`in`), when given, must match the one read off the
// previous unit.
absl::Status ExpectIn(const std::string& label, int64_t declared, int64_t actual,
                      const TensorType& in, const char* what) {
  if (declared == 0 || declared == actual) return absl::OkStatus();
  return Bad(label,
             absl::StrCat("declares in: ", declared, " ", what, " but its input ", ShapeString(in),
                          " has ", actual, "; use in: ", actual, " or leave it out"));
}

// --- The layer list -----------------------------------------------------------

// The most parameters one unit may hold (4 GiB of float32). Checked by
// arithmetic before a unit is built, so that no spec makes the shape pass
// (in the coordinator) or a worker allocate more and be killed for it.
constexpr double kMaxUnitParameters = double(int64_t{1} << 30);

// What the unit being built may still hold: at most kMaxUnitParameters, and
// in the shape pass what is left of the job's --max-model-bytes.
struct SizeLimit {
  double parameters = kMaxUnitParameters;
  int64_t model_bytes = 0;  // the budget it comes from; 0: the unit cap
};

absl::StatusOr<torch::nn::AnyModule> BuildLayer(const v1::UnitSpec& u, const TensorType& in,
                                                const std::string& field, const SizeLimit& limit);

absl::Status CheckSize(double parameters, const std::string& label, const SizeLimit& limit) {
  if (parameters <= limit.parameters) return absl::OkStatus();
  const auto n = static_cast<int64_t>(parameters);
  if (limit.model_bytes > 0) {
    return Bad(label, absl::StrCat("would hold ", n, " parameters (", n * 4,
                                   " bytes of float32), more than the ",
                                   static_cast<int64_t>(limit.parameters),
                                   " the model may still hold under the coordinator's "
                                   "--max-model-bytes ",
                                   limit.model_bytes,
                                   ": make the model smaller, or have the operator raise "
                                   "--max-model-bytes"));
  }
  return Bad(label, absl::StrCat("would hold ", n, " parameters; a unit may hold at most ",
                                 static_cast<int64_t>(kMaxUnitParameters),
                                 " (4 GiB of float32): make it smaller or split it into units"));
}

// Parameters layer `u` will hold on input `in` (a residual's body is checked
// layer by layer as it is built).
double LayerParameters(const v1::UnitSpec& u, const TensorType& in) {
  const double last = in.shape.empty() ? 0 : static_cast<double>(in.shape.back());
  const double channels = in.shape.size() == 3 ? static_cast<double>(in.shape[0]) : 0;
  const double out = static_cast<double>(u.out());
  const std::string& t = u.type();
  if (t == "linear") return last * out + out;
  if (t == "conv2d") {
    const double k = u.kernel() ? static_cast<double>(u.kernel()) : 3;
    return channels * out * k * k + out;
  }
  if (t == "batchnorm2d") return 2 * channels;
  if (t == "layernorm") return 2 * last;
  if (t == "embedding") return (double(u.vocab()) + double(u.context())) * double(u.dim());
  if (t == "transformer_block") {
    const double d = u.dim() ? static_cast<double>(u.dim()) : last;
    const double h = u.hidden() ? static_cast<double>(u.hidden()) : 4 * d;
    return 4 * d * d + 2 * d * h + 9 * d + h;
  }
  return 0;
}

// The layers `body` as one Sequential, checking each against its input.
absl::StatusOr<std::pair<torch::nn::Sequential, TensorType>> BuildChain(
    const google::protobuf::RepeatedPtrField<v1::UnitSpec>& body, TensorType in,
    const std::string& field, SizeLimit limit) {
  torch::nn::Sequential seq;
  for (int j = 0; j < body.size(); ++j) {
    const std::string f = absl::StrCat(field, "[", j, "]");
    auto layer = BuildLayer(body[j], in, f, limit);
    if (layer.ok()) {  // what the next layer of the chain may still hold
      for (const auto& p : layer->ptr()->parameters()) limit.parameters -= double(p.numel());
    }
    if (!layer.ok()) return layer.status();
    auto out = Probe(*layer, in, absl::StrCat(f, " (", body[j].type(), ")"));
    if (!out.ok()) return out.status();
    seq->push_back(*layer);
    in = *out;
  }
  return std::make_pair(seq, in);
}

absl::StatusOr<torch::nn::AnyModule> BuildLayer(const v1::UnitSpec& u, const TensorType& in,
                                                const std::string& field, const SizeLimit& limit) {
  namespace nn = torch::nn;
  const std::string& t = u.type();
  const std::string label = absl::StrCat(field, " (", t, ")");
  const bool bias = u.has_bias() ? u.bias() : true;
  if (auto st = CheckSize(LayerParameters(u, in), label, limit); !st.ok()) return st;
  auto positive = [&](const char* name, int64_t v) -> absl::Status {
    if (v >= 1) return absl::OkStatus();
    return Bad(absl::StrCat(field, ".", name),
               absl::StrCat("required for ", t, ", an integer >= 1 (is ", v, ")"));
  };
  if (t == "linear") {
    if (auto st = ExpectFloat(label, in, 0, "float [B, ..., features]"); !st.ok()) return st;
    if (auto st = positive("out", u.out()); !st.ok()) return st;
    const int64_t features = in.shape.back();
    if (auto st = ExpectIn(label, u.in(), features, in, "features"); !st.ok()) return st;
    return nn::AnyModule(nn::Linear(nn::LinearOptions(features, u.out()).bias(bias)));
  }
  if (t == "conv2d") {
    if (auto st = ExpectFloat(label, in, 3, "[B, C, H, W]"); !st.ok()) return st;
    if (auto st = positive("out", u.out()); !st.ok()) return st;
    if (auto st = ExpectIn(label, u.in(), in.shape[0], in, "channels"); !st.ok()) return st;
    const int64_t k = u.kernel() ? u.kernel() : 3;
    if (k < 1 || u.stride() < 0 || u.padding() < 0) {
      return Bad(field, "kernel must be >= 1, stride >= 1 and padding >= 0");
    }
    return nn::AnyModule(nn::Conv2d(nn::Conv2dOptions(in.shape[0], u.out(), k)
                                        .stride(u.stride() ? u.stride() : 1)
                                        .padding(u.padding())
                                        .bias(bias)));
  }
  if (t == "batchnorm2d") {
    if (auto st = ExpectFloat(label, in, 3, "[B, C, H, W]"); !st.ok()) return st;
    if (auto st = ExpectIn(label, u.in(), in.shape[0], in, "channels"); !st.ok()) return st;
    return nn::AnyModule(nn::BatchNorm2d(in.shape[0]));
  }
  if (t == "layernorm") {
    if (auto st = ExpectFloat(label, in, 0, "float [B, ..., features]"); !st.ok()) return st;
    if (auto st = ExpectIn(label, u.in(), in.shape.back(), in, "features"); !st.ok()) return st;
    return nn::AnyModule(nn::LayerNorm(nn::LayerNormOptions({in.shape.back()})));
  }
  if (t == "relu") return nn::AnyModule(nn::ReLU());
  if (t == "gelu") return nn::AnyModule(nn::GELU());
  if (t == "tanh") return nn::AnyModule(nn::Tanh());
  if (t == "sigmoid") return nn::AnyModule(nn::Sigmoid());
  if (t == "flatten") return nn::AnyModule(nn::Flatten());
  if (t == "dropout") {
    const double p = u.has_p() ? u.p() : 0.5;
    if (!(p >= 0 && p < 1)) return Bad(absl::StrCat(field, ".p"), "must be in [0, 1)");
    return nn::AnyModule(nn::Dropout(p));
  }
  if (t == "maxpool2d" || t == "avgpool2d") {
    if (auto st = ExpectFloat(label, in, 3, "[B, C, H, W]"); !st.ok()) return st;
    const int64_t k = u.kernel() ? u.kernel() : 2;
    const int64_t s = u.stride() ? u.stride() : k;
    if (k < 1 || s < 1 || u.padding() < 0 || 2 * u.padding() > k) {
      return Bad(field, "kernel and stride must be >= 1 and padding in 0..kernel/2");
    }
    if (t == "maxpool2d") {
      return nn::AnyModule(nn::MaxPool2d(nn::MaxPool2dOptions(k).stride(s).padding(u.padding())));
    }
    return nn::AnyModule(nn::AvgPool2d(nn::AvgPool2dOptions(k).stride(s).padding(u.padding())));
  }
  if (t == "adaptive_avgpool2d") {
    if (auto st = ExpectFloat(label, in, 3, "[B, C, H, W]"); !st.ok()) return st;
    const int64_t size = u.size() ? u.size() : 1;
    if (size < 1) return Bad(absl::StrCat(field, ".size"), "must be >= 1");
    return nn::AnyModule(nn::AdaptiveAvgPool2d(nn::AdaptiveAvgPool2dOptions(size)));
  }
  if (t == "embedding") {
    if (auto st = Expect(in.tokens && in.shape.size() == 1, label, in, "token ids [B, T]");
        !st.ok()) {
      return st;
    }
    if (auto st = positive("vocab", u.vocab()); !st.ok()) return st;
    if (auto st = positive("dim", u.dim()); !st.ok()) return st;
    if (u.context() < 0) return Bad(absl::StrCat(field, ".context"), "must be >= 0 (0 = none)");
    if (u.context() > 0 && in.shape[0] > u.context()) {
      return Bad(absl::StrCat(field, ".context"),
                 absl::StrCat(u.context(), " positions but the input has ", in.shape[0],
                              " tokens; use at least ", in.shape[0]));
    }
    return nn::AnyModule(EmbeddingUnit(u.vocab(), u.dim(), u.context()));
  }
  if (t == "transformer_block") {
    if (auto st = ExpectFloat(label, in, 2, "float [B, T, width]"); !st.ok()) return st;
    const int64_t dim = in.shape[1];
    if (u.dim() != 0 && u.dim() != dim) {
      return Bad(label, absl::StrCat("declares dim: ", u.dim(), " but its input ", ShapeString(in),
                                     " is ", dim, " wide"));
    }
    const int64_t heads = u.heads() ? u.heads() : 4;
    if (heads < 1 || dim % heads != 0) {
      return Bad(absl::StrCat(field, ".heads"),
                 absl::StrCat(heads, " heads do not divide the width ", dim));
    }
    const int64_t hidden = u.hidden() ? u.hidden() : 4 * dim;
    if (hidden < 1) return Bad(absl::StrCat(field, ".hidden"), "must be >= 1");
    const double p = u.has_p() ? u.p() : 0.0;
    if (!(p >= 0 && p < 1)) return Bad(absl::StrCat(field, ".p"), "must be in [0, 1)");
    return nn::AnyModule(TransformerBlock(dim, heads, hidden, p));
  }
  if (t == "residual") {
    if (u.body_size() == 0) {
      return Bad(absl::StrCat(field, ".body"), "required: the branch's layers, at least one");
    }
    auto body = BuildChain(u.body(), in, absl::StrCat(field, ".body"), limit);
    if (!body.ok()) return body.status();
    const TensorType& out = body->second;
    nn::Sequential shortcut;
    if (out.shape != in.shape) {
      const bool image = in.shape.size() == 3 && out.shape.size() == 3;
      if (image && in.shape[1] % out.shape[1] == 0 && in.shape[2] % out.shape[2] == 0 &&
          in.shape[1] / out.shape[1] == in.shape[2] / out.shape[2]) {
        const int64_t stride = in.shape[1] / out.shape[1];
        shortcut->push_back(
            nn::Conv2d(nn::Conv2dOptions(in.shape[0], out.shape[0], 1).stride(stride).bias(false)));
        shortcut->push_back(nn::BatchNorm2d(out.shape[0]));
      } else if (!in.tokens && in.shape.size() == out.shape.size() && !in.shape.empty() &&
                 std::equal(in.shape.begin(), in.shape.end() - 1, out.shape.begin())) {
        shortcut->push_back(nn::Linear(in.shape.back(), out.shape.back()));
      } else {
        return Bad(label,
                   absl::StrCat("its body turns ", ShapeString(in), " into ", ShapeString(out),
                                ", which no shortcut can match (a 1x1 conv2d "
                                "needs the same stride on both sides, a linear the same "
                                "leading dims)"));
      }
    }
    return nn::AnyModule(Residual(body->first, shortcut, /*relu_after=*/false));
  }
  return Bad(
      absl::StrCat(field, ".type"),
      absl::StrCat("'", t, "' is not a layer type; allowed: ", absl::StrJoin(LayerTypes(), ", ")));
}

// --- The zoo ------------------------------------------------------------------

torch::nn::AnyModule Activation(const std::string& name) {
  if (name == "tanh") return torch::nn::AnyModule(torch::nn::Tanh());
  if (name == "gelu") return torch::nn::AnyModule(torch::nn::GELU());
  if (name == "sigmoid") return torch::nn::AnyModule(torch::nn::Sigmoid());
  return torch::nn::AnyModule(torch::nn::ReLU());
}

torch::nn::Conv2d Conv3x3(int64_t in, int64_t out, int64_t stride) {
  return torch::nn::Conv2d(
      torch::nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false));
}

// Parameters unit u of a zoo model will hold (upper bounds), before it is built.
double ZooUnitParameters(const v1::ModelSpec& m, ModelKind kind, int u, int total,
                         const TensorType& in) {
  const double first = in.shape.empty() ? 0 : static_cast<double>(in.shape[0]);
  if (kind == ModelKind::kMlp)
    return double(m.layers(u)) * double(m.layers(u + 1)) + m.layers(u + 1);
  const double classes = static_cast<double>(m.classes());
  const double w = m.width();
  if (kind == ModelKind::kResNet) {
    if (u == 0) return first * w * 9 + 2 * w;
    if (u == total - 1) return first * classes + classes;
    const int n = (m.depth() - 2) / 6;
    const double out = w * double(int64_t{1} << std::min(((u - 1) / n), 40));
    return 2 * 9 * out * out + first * out + 6 * out;
  }
  if (u == 0) return (classes + m.context()) * w;
  if (u == total - 1) return w * classes + classes + 2 * w;
  return 12 * w * w + 13 * w;
}

// The layers of unit u of a zoo model, given the unit's input.
absl::StatusOr<torch::nn::Sequential> ZooUnit(const v1::ModelSpec& m, ModelKind kind, int u,
                                              int total, const TensorType& in,
                                              const std::string& label, const SizeLimit& limit) {
  namespace nn = torch::nn;
  nn::Sequential seq;
  if (auto st = CheckSize(ZooUnitParameters(m, kind, u, total, in), label, limit); !st.ok())
    return st;
  if (kind == ModelKind::kMlp) {
    const int64_t features = Numel(in.shape);
    if (in.tokens || features != m.layers(u)) {
      return Bad(absl::StrCat("model.layers[", u, "]"),
                 absl::StrCat("is ", m.layers(u), " but the input ", ShapeString(in), " has ",
                              features, " features; use ", features));
    }
    if (in.shape.size() != 1) seq->push_back(nn::Flatten());
    nn::Linear linear(m.layers(u), m.layers(u + 1));
    if (m.init() == "he") {
      torch::NoGradGuard no_grad;
      nn::init::kaiming_normal_(linear->weight, 0, torch::kFanIn, torch::kReLU);
      linear->bias.zero_();
    }
    seq->push_back(linear);
    if (u + 1 < total) seq->push_back(Activation(m.activation()));
    return seq;
  }
  if (kind == ModelKind::kResNet) {
    const int n = (m.depth() - 2) / 6;
    const int64_t w = m.width();
    if (u == 0) {
      if (auto st = ExpectFloat(label, in, 3, "images [B, C, H, W]"); !st.ok()) return st;
      seq->push_back(Conv3x3(in.shape[0], w, 1));
      seq->push_back(nn::BatchNorm2d(w));
      seq->push_back(nn::ReLU());
      return seq;
    }
    if (u == total - 1) {
      if (auto st = ExpectFloat(label, in, 3, "[B, C, H, W]"); !st.ok()) return st;
      seq->push_back(nn::AdaptiveAvgPool2d(nn::AdaptiveAvgPool2dOptions(1)));
      seq->push_back(nn::Flatten());
      seq->push_back(nn::Linear(in.shape[0], m.classes()));
      return seq;
    }
    if (auto st = ExpectFloat(label, in, 3, "[B, C, H, W]"); !st.ok()) return st;
    const int b = u - 1, group = b / n, j = b % n;
    const int64_t out = w << group;
    const int64_t stride = group > 0 && j == 0 ? 2 : 1;
    nn::Sequential body;
    body->push_back(Conv3x3(in.shape[0], out, stride));
    body->push_back(nn::BatchNorm2d(out));
    body->push_back(nn::ReLU());
    body->push_back(Conv3x3(out, out, 1));
    body->push_back(nn::BatchNorm2d(out));
    nn::Sequential shortcut;
    if (stride != 1 || in.shape[0] != out) {
      shortcut->push_back(
          nn::Conv2d(nn::Conv2dOptions(in.shape[0], out, 1).stride(stride).bias(false)));
      shortcut->push_back(nn::BatchNorm2d(out));
    }
    seq->push_back(Residual(body, shortcut, /*relu_after=*/true));
    return seq;
  }
  // transformer_lm
  const int64_t w = m.width();
  if (u == 0) {
    if (auto st = Expect(in.tokens && in.shape.size() == 1, label, in, "token ids [B, T]");
        !st.ok()) {
      return st;
    }
    if (in.shape[0] > m.context()) {
      return Bad("model.context", absl::StrCat(m.context(), " positions but the input has ",
                                               in.shape[0], " tokens; use at least ", in.shape[0]));
    }
    seq->push_back(EmbeddingUnit(m.classes(), w, m.context()));
    return seq;
  }
  if (auto st = ExpectFloat(label, in, 2, absl::StrCat("[B, T, ", w, "]")); !st.ok()) return st;
  if (auto st = Expect(in.shape[1] == w, label, in, absl::StrCat("[B, T, ", w, "]")); !st.ok()) {
    return st;
  }
  if (u == total - 1) {
    seq->push_back(nn::LayerNorm(nn::LayerNormOptions({w})));
    seq->push_back(nn::Linear(w, m.classes()));
    return seq;
  }
  seq->push_back(TransformerBlock(w, m.heads(), 4 * w, m.dropout()));
  return seq;
}

// What unit u of a zoo model is, e.g. "resnet stem", "transformer_lm block".
std::string ZooPart(const v1::ModelSpec& m, ModelKind kind, int u, int total) {
  if (kind == ModelKind::kMlp) return "linear";
  const bool resnet = kind == ModelKind::kResNet;
  const char* part = u == 0           ? (resnet ? "stem" : "embedding")
                     : u == total - 1 ? (resnet ? "head" : "norm and head")
                                      : "block";
  return absl::StrCat(m.type(), " ", part);
}

// A TorchScript nn.Sequential from a file's bytes; errors name model.path and,
// when given, the file (`file`).
absl::StatusOr<torch::jit::Module> LoadScript(const std::string& bytes,
                                              const std::string& file = "") {
  const std::string where = file.empty() ? "" : absl::StrCat("'", file, "' ");
  torch::jit::Module module;
  try {
    std::istringstream in(bytes);
    module = torch::jit::load(in, torch::Device(torch::kCPU));  // map_location: CPU
  } catch (const std::exception& e) {
    return Bad("model.path", absl::StrCat(where, "is not a TorchScript file: ", TorchMessage(e)));
  }
  const std::string type = module.type()->name() ? module.type()->name()->name() : "";
  if (type != "Sequential") {
    return Bad("model.path", absl::StrCat(where, "holds a TorchScript '", type,
                                          "', not an nn.Sequential; script an nn.Sequential "
                                          "whose top-level children are the pipeline's units"));
  }
  if (module.children().size() == 0) {
    return Bad("model.path", absl::StrCat(where,
                                          "holds an nn.Sequential without children; it "
                                          "needs at least one unit"));
  }
  return module;
}

// Where a model's units come from: the spec, and for torchscript the file's
// top-level children (the file is loaded once). Build() makes one unit, so
// a whole stage, the shape pass and profiling all build units the same way.
class UnitSource {
 public:
  static absl::StatusOr<UnitSource> Open(const v1::ModelSpec& model,
                                         const std::string& torchscript) {
    auto kind = ParseModelKind(model.type());
    if (!kind.ok()) return kind.status();
    if ((*kind == ModelKind::kResNet || *kind == ModelKind::kTransformerLm) &&
        model.classes() < 1) {
      return Bad("model.classes", "not resolved from the data (ResolveModel)");
    }
    UnitSource source(model, *kind);
    if (*kind == ModelKind::kTorchScript) {
      auto module = LoadScript(torchscript);
      if (!module.ok()) return module.status();
      for (const auto& c : module->children()) source.children_.push_back(c);
      source.total_ = static_cast<int>(source.children_.size());
    } else {
      source.total_ = ModelUnitCount(model);
    }
    return source;
  }

  int total() const { return total_; }

  // Unit u on input `in`, its weights drawn from a generator seeded with
  // (seed, u) so that they do not depend on the partition; checked against
  // its input by one probe forward.
  absl::StatusOr<std::pair<torch::nn::AnyModule, UnitInfo>> Build(
      int u, int64_t seed, const TensorType& in, const SizeLimit& limit = {}) const {
    torch::manual_seed(static_cast<uint64_t>(seed) * 1000003ULL + static_cast<uint64_t>(u));
    const v1::ModelSpec& m = model_;
    UnitInfo info;
    info.in = in;
    std::string label;
    if (kind_ == ModelKind::kSequential) {
      info.name = m.units(u).type();
      label = absl::StrCat("model.units[", u, "] (", info.name, ")");
    } else if (kind_ == ModelKind::kTorchScript) {
      info.name = children_[u].type()->name() ? children_[u].type()->name()->name() : "module";
      label = absl::StrCat("unit ", u, " (", info.name, ")");
    } else {
      info.name = ZooPart(m, kind_, u, total_);
      label = kind_ == ModelKind::kMlp ? absl::StrCat("model.layers[", u, "]")
                                       : absl::StrCat("unit ", u, " (", info.name, ")");
    }
    torch::nn::AnyModule unit;
    try {
      if (kind_ == ModelKind::kTorchScript) {
        unit = torch::nn::AnyModule(ScriptUnit(children_[u]));
      } else {
        absl::StatusOr<torch::nn::Sequential> layers;
        if (kind_ == ModelKind::kSequential) {
          auto layer = BuildLayer(m.units(u), in, absl::StrCat("model.units[", u, "]"), limit);
          if (!layer.ok()) return layer.status();
          layers = torch::nn::Sequential();
          (*layers)->push_back(*layer);
        } else {
          layers = ZooUnit(m, kind_, u, total_, in, label, limit);
          if (!layers.ok()) return layers.status();
        }
        unit = torch::nn::AnyModule(Unit(*layers));
      }
    } catch (const std::exception& e) {
      return Bad(label,
                 absl::StrCat("cannot be built on input ", ShapeString(in), ": ", TorchMessage(e)));
    }
    auto out = Probe(unit, in, label);
    if (!out.ok()) return out.status();
    info.out = *out;
    for (const auto& p : unit.ptr()->parameters()) info.parameters += p.numel();
    return std::make_pair(std::move(unit), std::move(info));
  }

 private:
  UnitSource(const v1::ModelSpec& model, ModelKind kind) : model_(model), kind_(kind) {}
  v1::ModelSpec model_;
  ModelKind kind_;  // parsed once, in Open
  std::vector<torch::jit::Module> children_;
  int total_ = 0;
};

}  // namespace

absl::Status CheckExampleShape(const std::vector<int64_t>& shape, int64_t batch,
                               const std::string& field) {
  if (shape.empty() || shape.size() > 8) return Bad(field, "1..8 dimensions per example");
  int64_t elements = std::max<int64_t>(batch, 1);
  for (int64_t d : shape) {
    if (d < 1 || d > (int64_t{1} << 24)) return Bad(field, "each dimension in 1..16777216");
    elements *= d;
    if (elements > (int64_t{1} << 31)) {
      return Bad(field, absl::StrCat("at most 2^31 elements in ", batch, " examples"));
    }
  }
  return absl::OkStatus();
}

std::string ShapeString(const TensorType& t) {
  return absl::StrCat("[B", t.shape.empty() ? "" : ", ", absl::StrJoin(t.shape, ", "), "]",
                      t.tokens ? " token ids" : "");
}

absl::StatusOr<std::string> ReadTorchScript(const std::string& path, int64_t max_model_bytes) {
  // The file travels to every worker inside its stage assignment, an RPC of
  // at most 256 MiB (common/rpc.h).
  constexpr uintmax_t kMaxBytes = 192u << 20;
  if (auto access = CheckReadableFile(path, "model.path"); !access.ok()) return access;
  std::error_code ec;
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (!ec && size > kMaxBytes) {
    return Bad("model.path",
               absl::StrCat("'", path, "' is ", size,
                            " bytes; a TorchScript model may "
                            "be at most ",
                            kMaxBytes, " (it is sent to every worker): use a smaller model"));
  }
  if (!ec && max_model_bytes > 0 && size > static_cast<uintmax_t>(max_model_bytes)) {
    return Bad("model.path", absl::StrCat("'", path, "' is ", size,
                                          " bytes, more than the coordinator's --max-model-bytes ",
                                          max_model_bytes,
                                          ": use a smaller model, or have the operator raise "
                                          "--max-model-bytes"));
  }
  std::ifstream f(path, std::ios::binary);
  if (!f || std::filesystem::is_directory(path, ec)) {
    return Bad("model.path", absl::StrCat("cannot open '", path, "'"));
  }
  std::stringstream bytes;
  bytes << f.rdbuf();
  std::string s = bytes.str();
  if (auto module = LoadScript(s, path); !module.ok()) return module.status();
  return s;
}

absl::StatusOr<int> CountUnits(const v1::ModelSpec& model, const std::string& torchscript) {
  auto source = UnitSource::Open(model, torchscript);
  if (!source.ok()) return source.status();
  return source->total();
}

absl::StatusOr<BuiltUnits> BuildUnits(const v1::ModelSpec& model, int first_unit, int units,
                                      int64_t seed, const TensorType& input,
                                      const std::string& torchscript) {
  auto source = UnitSource::Open(model, torchscript);
  if (!source.ok()) return source.status();
  if (first_unit < 0 || units < 1 || first_unit + units > source->total()) {
    return Bad("units", absl::StrCat("range [", first_unit, ", ", first_unit + units,
                                     ") is outside the model's ", source->total(), " units"));
  }
  BuiltUnits built;
  TensorType in = input;
  for (int u = first_unit; u < first_unit + units; ++u) {
    auto unit = source->Build(u, seed, in);
    if (!unit.ok()) return unit.status();
    built.module->push_back(std::move(unit->first));
    built.units.push_back(std::move(unit->second));
    in = built.units.back().out;
  }
  return built;
}

absl::StatusOr<std::vector<UnitInfo>> ShapePass(const v1::ModelSpec& model, const TensorType& input,
                                                const std::string& torchscript,
                                                int64_t max_model_bytes) {
  auto source = UnitSource::Open(model, torchscript);
  if (!source.ok()) return source.status();
  if (source->total() < 1) return Bad("model", "has no units");
  // One unit at a time: the coordinator holds at most one unit's weights
  // (beyond a TorchScript file's, which it has read), and each unit is
  // checked by arithmetic against what the budget has left before it is
  // allocated.
  std::vector<UnitInfo> units;
  TensorType in = input;
  double left = max_model_bytes > 0 ? double(max_model_bytes) / 4 : kMaxUnitParameters;
  for (int u = 0; u < source->total(); ++u) {
    SizeLimit limit;
    if (max_model_bytes > 0 && left < kMaxUnitParameters) limit = {left, max_model_bytes};
    auto unit = source->Build(u, 0, in, limit);
    if (!unit.ok()) return unit.status();
    units.push_back(std::move(unit->second));
    in = units.back().out;
    if (max_model_bytes > 0) {
      left -= double(units.back().parameters);
      if (left < 0) {  // a TorchScript unit (loaded with its file) past the budget
        return Bad(absl::StrCat("unit ", u, " (", units.back().name, ")"),
                   absl::StrCat("brings the model past the coordinator's --max-model-bytes ",
                                max_model_bytes,
                                " of float32 parameters: make the model smaller, "
                                "or have the operator raise --max-model-bytes"));
      }
    }
  }
  return units;
}

absl::StatusOr<ModelPlan> PlanModel(const v1::JobSpec& spec, const DataInfo& data,
                                    int64_t max_model_bytes) {
  auto kind = ParseModelKind(spec.model().type());
  if (!kind.ok()) return kind.status();
  const std::optional<DataKind> data_kind = DataKindOf(spec.data().type());
  if (*kind == ModelKind::kMlp && data_kind && IsIdx(*data_kind)) {
    // An MLP's widths against idx files: the error names the file the
    // number comes from (the shape pass below could only name the shape).
    if (auto st = CheckDataset(spec); !st.ok()) return st;
  }
  ModelPlan plan;
  plan.model = spec.model();
  const bool lm = data.task == Task::kLanguageModel;
  const int64_t context = lm && !data.input_shape.empty() ? data.input_shape[0] : 0;
  if (auto st = ResolveModel(plan.model, data.classes, context); !st.ok()) return st;
  if (*kind == ModelKind::kTorchScript) {
    auto bytes = ReadTorchScript(plan.model.path(), max_model_bytes);
    if (!bytes.ok()) return bytes.status();
    plan.torchscript = std::move(*bytes);
  }
  plan.input = TensorType{data.input_shape, data.token_input()};
  auto units = ShapePass(plan.model, plan.input, plan.torchscript, max_model_bytes);
  if (!units.ok()) return units.status();
  plan.units = std::move(*units);
  const int total = static_cast<int>(plan.units.size());
  const UnitInfo& last = plan.units.back();
  const std::string last_label =
      *kind == ModelKind::kSequential ? absl::StrCat("model.units[", total - 1, "]")
      : *kind == ModelKind::kMlp      ? absl::StrCat("model.layers[", total, "]")
                                      : absl::StrCat("unit ", total - 1, " (the last)");
  if (lm) {
    const bool ok = last.out.shape.size() == 2 && last.out.shape[0] == context &&
                    last.out.shape[1] >= data.classes;
    if (!ok) {
      return Bad(last_label, absl::StrCat("gives ", ShapeString(last.out),
                                          " but a language model on this data must give "
                                          "logits [B, ",
                                          context, ", ", data.classes, "] (context x vocabulary)"));
    }
  } else {
    const bool ok = last.out.shape.size() == 1 && last.out.shape[0] >= data.classes;
    if (!ok) {
      return Bad(last_label,
                 absl::StrCat("gives ", ShapeString(last.out), " but the data has ", data.classes,
                              " classes: the model must end in logits [B, ", data.classes, "]"));
    }
  }
  const auto& s = spec.schedule();
  if (s.stages() > total) {
    return Bad("schedule.stages", absl::StrCat(s.stages(), " stages but the model has only ", total,
                                               " units; use at most ", total));
  }
  if (PartitionOf(s.partition()) == PartitionKind::kSplit) {
    std::vector<int> split(s.split().begin(), s.split().end());
    if (auto r = PartitionFromSplit(split, total, s.stages()); !r.ok()) return r.status();
  }
  return plan;
}

absl::StatusOr<UnitCosts> ProfileUnits(const v1::ModelSpec& model, const std::string& torchscript,
                                       const TensorType& input, int64_t vocab, int microbatch_size,
                                       int repeats, int64_t seed, torch::Device device) {
  if (microbatch_size < 1) return Bad("microbatch_size", "must be >= 1");
  if (repeats < 1) repeats = 3;
  auto source = UnitSource::Open(model, torchscript);
  if (!source.ok()) return source.status();
  UnitCosts costs;
  TensorType in = input;
  try {
    std::vector<int64_t> shape = {microbatch_size};
    shape.insert(shape.end(), input.shape.begin(), input.shape.end());
    torch::manual_seed(static_cast<uint64_t>(seed));
    torch::Tensor x = input.tokens ? torch::randint(std::max<int64_t>(vocab, 1), shape,
                                                    torch::TensorOptions(torch::kLong))
                                   : torch::randn(shape);
    x = x.to(device);
    using Clock = std::chrono::steady_clock;
    auto seconds = [](Clock::time_point a) {
      return std::chrono::duration<double>(Clock::now() - a).count();
    };
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    // One unit at a time: the worker holds at most one unit's weights.
    for (int u = 0; u < source->total(); ++u) {
      auto unit = source->Build(u, seed, in);
      if (!unit.ok()) return unit.status();
      torch::nn::AnyModule& any = unit->first;
      any.ptr()->to(device);
      any.ptr()->train();
      std::vector<double> fwd, bwd;
      torch::Tensor out;
      for (int r = 0; r <= repeats; ++r) {  // run 0 warms up
        auto t0 = Clock::now();
        {
          torch::NoGradGuard no_grad;
          out = any.forward(x);
        }
        if (device.is_cuda()) torch::cuda::synchronize();
        if (r > 0) fwd.push_back(seconds(t0));
        torch::Tensor g = torch::randn_like(out);
        t0 = Clock::now();
        torch::Tensor xin = x.detach();
        if (xin.is_floating_point()) xin.requires_grad_(true);
        torch::Tensor y = any.forward(xin);
        y.backward(g);
        if (device.is_cuda()) torch::cuda::synchronize();
        if (r > 0) bwd.push_back(seconds(t0));
      }
      costs.forward_seconds.push_back(median(fwd));
      costs.backward_seconds.push_back(median(bwd));
      costs.parameters.push_back(unit->second.parameters);
      in = unit->second.out;
      x = out.detach();
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("profiling the model: ", TorchMessage(e)));
  }
  return costs;
}

}  // namespace pipemare
