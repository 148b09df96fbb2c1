// The shared shell of every cadence primitive's eval_cpu: allocate the output, tell
// the stream's encoder what is read and written, and run `body` on the stream's thread.
#pragma once

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

}  // namespace cadence_cpu
