// The gated MLPs' activations, act(g) = g * sigmoid(z(g)): SiLU z = g; GELU's tanh form (Gemma's GeGLU,
// transformers' gelu_pytorch_tanh) 0.5 g (1 + tanh(a)) = g * sigmoid(2a), a = sqrt(2 / pi) (g + 0.044715 g^3).
// One form for both lets every epilogue that makes silu(gate) * up make gelu(gate) * up as well.
#pragma once

#include <cmath>

namespace freight {

enum class Gate { kSilu, kGeluTanh };

// z(g): 2 sqrt(2 / pi) (g + 0.044715 g^3) = g (1.5957691 + 0.0713548 g^2) for GELU.
constexpr float kGeluLinear = 1.5957691216057308f;
constexpr float kGeluCubic = 0.0713548162726009f;

template <Gate G>
inline float sigmoid_argument(float g) {
  if constexpr (G == Gate::kSilu) return g;
  else return g * (kGeluLinear + kGeluCubic * g * g);
}

template <Gate G>
inline float gate_activation(float g) {
  return g / (1.f + std::exp(-sigmoid_argument<G>(g)));
}

}  // namespace freight
