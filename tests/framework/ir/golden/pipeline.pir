// RUN: canonicalize,cse,fuse-patterns,dce
// A small MLP block as a tracer would emit it: redundant ops, identities and a fusable tail.
module {
  func @mlp(%x: f32[B, S, 8], %wg: f32[16, 8], %wu: f32[16, 8], %wd: f32[8, 16], %bd: f32[8]) -> (f32[B, S, 8]) {
    %one = llm.full() {shape = [], value = 1.0} : f32[]
    %xs = llm.mul(%x, %one) : f32[B, S, 8]
    %x2 = llm.reshape(%xs) {shape = [-1, 8]} : f32[B*S, 8]
    %x3 = llm.reshape(%x2) {shape = [B*S, 8]} : f32[B*S, 8]
    %g = llm.matmul(%x3, %wg) {transpose_y = true} : f32[B*S, 16]
    %u = llm.matmul(%x2, %wu) {transpose_y = true} : f32[B*S, 16]
    %g2 = llm.matmul(%x3, %wg) {transpose_y = true} : f32[B*S, 16]
    %a = llm.silu(%g2) : f32[B*S, 16]
    %h = llm.mul(%u, %a) : f32[B*S, 16]
    %d = llm.matmul(%h, %wd) {transpose_y = true} : f32[B*S, 8]
    %o = llm.add(%d, %bd) : f32[B*S, 8]
    %y = llm.reshape(%o) {shape = [B, S, 8]} : f32[B, S, 8]
    return %y
  }
}
// CHECK:
module {
  func @mlp(%x: f32[B, S, 8], %wg: f32[16, 8], %wu: f32[16, 8], %wd: f32[8, 16], %bd: f32[8]) -> (f32[B, S, 8]) {
    %x2 = llm.reshape(%x) {shape = [-1, 8]} : f32[B*S, 8]
    %u = llm.matmul(%x2, %wu) {transpose_y = true} : f32[B*S, 16]
    %g2 = llm.matmul(%x2, %wg) {transpose_y = true} : f32[B*S, 16]
    %h = llm.swiglu(%g2, %u) : f32[B*S, 16]
    %o = llm.linear(%h, %wd, %bd) : f32[B*S, 8]
    %y = llm.reshape(%o) {shape = [B, S, 8]} : f32[B, S, 8]
    return %y
  }
}
