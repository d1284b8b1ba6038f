// RUN: simplify-shapes{bind = {B = 2, T = S}}
// Symbols are substituted everywhere (types, attributes), types are re-inferred, reshape's -1
// is written out, and numel over static dims becomes a constant.
module {
  func @main(%x: f32[B, S, 8], %y: f32[B, T, 8]) -> (f32[B, S, 8], f32[B*S, 8], f32[], f32[B, S+T, 8]) {
    %a = llm.add(%x, %x) : f32[B, S, 8]
    %r = llm.reshape(%a) {shape = [-1, 8]} : f32[B*S, 8]
    %n = llm.numel(%x) {axis = [0, 2]} : f32[]
    %c = llm.concat(%x, %y) {axis = 1} : f32[B, S+T, 8]
    return %a, %r, %n, %c
  }
}
// CHECK:
module {
  func @main(%x: f32[2, S, 8], %y: f32[2, S, 8]) -> (f32[2, S, 8], f32[2*S, 8], f32[], f32[2, 2*S, 8]) {
    %a = llm.add(%x, %x) : f32[2, S, 8]
    %r = llm.reshape(%a) {shape = [2*S, 8]} : f32[2*S, 8]
    %n = builtin.constant() {value = dense<f32[] [16.0]>} : f32[]
    %c = llm.concat(%x, %y) {axis = 1} : f32[2, 2*S, 8]
    return %a, %r, %n, %c
  }
}
