// RUN: canonicalize
// transpose∘transpose composes (to nothing when the perms cancel), reshape∘reshape keeps the
// last shape, and no-op casts, reshapes, expands, slices and single concats disappear.
module {
  func @main(%x: f32[2, 3, 4], %y: f32[B, 6]) -> (f32[2, 3, 4], f32[4, 2, 3], f32[B, 2, 3], f32[2, 3, 4]) {
    %t1 = llm.transpose(%x) {perm = [1, 0, 2]} : f32[3, 2, 4]
    %t2 = llm.transpose(%t1) {perm = [1, 0, 2]} : f32[2, 3, 4]
    %u1 = llm.transpose(%x) {perm = [0, 2, 1]} : f32[2, 4, 3]
    %u2 = llm.transpose(%u1) {perm = [1, 0, 2]} : f32[4, 2, 3]
    %r1 = llm.reshape(%y) {shape = [B, 3, 2]} : f32[B, 3, 2]
    %r2 = llm.reshape(%r1) {shape = [B, 2, -1]} : f32[B, 2, 3]
    %c = llm.cast(%t2) {dtype = f32} : f32[2, 3, 4]
    %r = llm.reshape(%c) {shape = [2, 3, 4]} : f32[2, 3, 4]
    %e = llm.expand(%r) {shape = [2, -1, 4]} : f32[2, 3, 4]
    %s = llm.slice(%e) {axes = [1], starts = [0], ends = [9223372036854775807]} : f32[2, 3, 4]
    %k = llm.concat(%s) {axis = 1} : f32[2, 3, 4]
    return %k, %u2, %r2, %t2
  }
}
// CHECK:
module {
  func @main(%x: f32[2, 3, 4], %y: f32[B, 6]) -> (f32[2, 3, 4], f32[4, 2, 3], f32[B, 2, 3], f32[2, 3, 4]) {
    %u2 = llm.transpose(%x) {perm = [2, 0, 1]} : f32[4, 2, 3]
    %r2 = llm.reshape(%y) {shape = [B, 2, -1]} : f32[B, 2, 3]
    return %x, %u2, %r2, %x
  }
}
