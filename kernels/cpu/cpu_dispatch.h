// The shared shell of every cadence primitive's eval_cpu: allocate the output, tell
// the stream's encoder what is read and written, and run `body` on the stream's thread.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

namespace cadence_cpu {

template <class Body>  // Body: void(std::vector<mx::array>& inputs, mx::array& out)
void run_on_stream(
    mlx::core::Stream stream,
    const std::vector<mlx::core::array>& inputs,
    mlx::core::array& out,
    Body body) {
  namespace mx = mlx::core;
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  std::vector<mx::array> weak_inputs;
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
    weak_inputs.push_back(mx::array::unsafe_weak_copy(a));
  }
  encoder.set_output_array(out);
  encoder.dispatch([inputs = std::move(weak_inputs), out = mx::array::unsafe_weak_copy(out),
                    body = std::move(body)]() mutable { body(inputs, out); });
}

// A kernel's reused buffer, at least n elements long: grown, never shrunk. (resize
// zero-fills whatever it grows, and a step's layers alternate between sizes: the panel
// kernel's packed x went from K = 1024 to the FFN's 2816 and back every layer, and
// zeroing it was 1% of a 16-row decode step.)
template <class T>
T* scratch(std::vector<T>& buffer, size_t n) {
  if (buffer.size() < n) {
    buffer.resize(n);
  }
  return buffer.data();
}

// Rows of an x [..., K]: the product of its leading dimensions (K may be 0).
inline int leading_rows(const mlx::core::array& x) {
  int64_t rows = 1;
  for (int d = 0; d + 1 < static_cast<int>(x.ndim()); ++d) {
    rows *= x.shape(d);
  }
  return static_cast<int>(rows);
}

// An input's elements in row-major order. mlx hands a primitive its inputs as they
// lie (a slice, a transpose, a broadcast); the kernels read dense rows. A dense input
// is read in place, any other is copied once into `copy`. Wrapping every input in
// mx::contiguous at graph time instead added one op per input, ~540 of a decode step.
template <class T>
const T* row_major_data(const mlx::core::array& a, std::vector<T>& copy) {
  if (a.flags().row_contiguous) {
    return a.data<T>();
  }
  copy.resize(a.size());
  const int ndim = a.ndim();
  std::vector<int> index(ndim, 0);
  const T* src = a.data<T>();
  int64_t offset = 0;
  for (size_t i = 0; i < copy.size(); ++i) {
    copy[i] = src[offset];
    for (int d = ndim - 1; d >= 0; --d) {  // the next index, last axis fastest
      offset += a.strides(d);
      if (++index[d] < a.shape(d)) {
        break;
      }
      offset -= a.strides(d) * a.shape(d);
      index[d] = 0;
    }
  }
  return copy.data();
}

}  // namespace cadence_cpu
