// RUN: none
// The printer's form is canonical: attributes equal to an op's default are left out, op-table
// attributes are normalized (an int where a float is declared, a dtype named in full), dims are
// canonical, numbered values are renumbered in order and kept names stay (made unique).
module{func @main(%arg: f32[S*B,4],%7:f32[4]) -> (f32[B*S, 4], f32[B*S, 4], f32[B*S, 4], f32[B*S, 4]) {
  %h = llm.rms_norm(%arg, %7) {eps = 1} : f32[B*S, 4]    // eps is a float
  %3 = llm.matmul(%h, %h) {transpose_x = false, transpose_y = true} : f32[B*S, B*S]
  %h_1 = llm.cast(%h) {dtype = "float64"} : f64[B * S, 4]
  %9 = llm.softmax(%h) {axis = -1} : f32[S*B, 4]
  %x = llm.gelu(%9) {approximate = "tanh"} : f32[B*S, 4]
  %x_2 = llm.gelu(%9) {approximate = "none"} : f32[B*S, 4]
  return %h, %9, %x, %x_2
}}
// CHECK:
module {
  func @main(%arg: f32[B*S, 4], %0: f32[4]) -> (f32[B*S, 4], f32[B*S, 4], f32[B*S, 4], f32[B*S, 4]) {
    %h = llm.rms_norm(%arg, %0) {eps = 1.0} : f32[B*S, 4]
    %1 = llm.matmul(%h, %h) {transpose_y = true} : f32[B*S, B*S]
    %h_1 = llm.cast(%h) {dtype = f64} : f64[B*S, 4]
    %2 = llm.softmax(%h) : f32[B*S, 4]
    %x = llm.gelu(%2) {approximate = "tanh"} : f32[B*S, 4]
    %x_2 = llm.gelu(%2) : f32[B*S, 4]
    return %h, %2, %x, %x_2
  }
}
