// RUN: fold-constants,dce
// Ops over constants are evaluated with the op-table kernels (chains in one sweep); symbolic
// shapes and results over max_elements stay as ops.
module {
  func @main(%x: f32[2]) -> (f32[2], f32[2, 2], i64[S], f32[64, 64]) {
    %c = builtin.constant() {value = dense<f32[2] [1.0, 4.0]>} : f32[2]
    %s = llm.sqrt(%c) : f32[2]
    %n = llm.neg(%s) : f32[2]
    %y = llm.add(%x, %n) : f32[2]
    %e = llm.full() {shape = [2, 2], value = 0.5} : f32[2, 2]
    %m = llm.matmul(%e, %e) : f32[2, 2]
    %r = llm.arange() {end = S} : i64[S]
    %big = llm.full() {shape = [64, 64], value = 1.0} : f32[64, 64]
    return %y, %m, %r, %big
  }
}
// CHECK:
module {
  func @main(%x: f32[2]) -> (f32[2], f32[2, 2], i64[S], f32[64, 64]) {
    %n = builtin.constant() {value = dense<f32[2] [-1.0, -2.0]>} : f32[2]
    %y = llm.add(%x, %n) : f32[2]
    %m = builtin.constant() {value = dense<f32[2, 2] [0.5, 0.5, 0.5, 0.5]>} : f32[2, 2]
    %r = llm.arange() {end = S} : i64[S]
    %big = llm.full() {shape = [64, 64], value = 1.0} : f32[64, 64]
    return %y, %m, %r, %big
  }
}
