// RUN: none
// Every piece of the syntax: several functions, function attributes, block-argument names,
// fusion regions, dist ops with typed mesh and placements, every attribute kind, special floats,
// escaped strings, multi-result ops and a constant large enough to live in the resources.
module {
  func @forward(%x: f32[B, 4], %w: f32[4, 4]) -> (f32[B, 4], f32[B, 2], f32[B, 2]) attributes {donate = [1], note = "a \"quoted\"\nline", weird = {"a b" = none}} {
    %f = cinn.fusion() : f32[B, 4] {
      %a = llm.exp(%x) : f32[B, 4]
      %b = llm.mul(%a, %x) : f32[B, 4]
      cinn.yield(%b)
    }
    %k = cinn.kernel(%f, %w) {kernel = "fused_0", grid = [4, 1], tuned = true, scale = -0.0} : f32[B, 4]
    %r = dist.reshard(%k) {mesh = #mesh<[2, 2], ["dp", "tp"]>, placements = [#shard<0>, #replicate<>]} : f32[B, 4]
    %lo, %hi = llm.split(%r) {sections = [2, 2], axis = 1} : f32[B, 2], f32[B, 2]
    %sent = dist.send(%lo) {peer = 1} : f32[B, 2]
    return %r, %lo, %hi
  }
  func @consts() -> (f32[2, 3], i64[4], bool[2], f32[], bf16[2], f32[20]) {
    %a = builtin.constant() {value = dense<f32[2, 3] [0.1, -2.5, inf, -inf, nan, 1e-30]>} : f32[2, 3]
    %i = builtin.constant() {value = dense<i64[4] [0, -1, 9223372036854775807, -9223372036854775808]>} : i64[4]
    %m = builtin.constant() {value = dense<bool[2] [true, false]>} : bool[2]
    %s = builtin.constant() {value = dense<f32[] [3.0]>} : f32[]
    %h = builtin.constant() {value = dense<bf16[2] [0.1, 65280.0]>} : bf16[2]
    %big = builtin.constant() {value = dense<f32[20] [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0, 18.0, 19.0]>} : f32[20]
    return %a, %i, %m, %s, %h, %big
  }
  func @params() -> (f32[S+1, 8], i64[S]) {
    %w = builtin.parameter() {name = "layers.0.mlp.weight"} : f32[S+1, 8]
    %r = llm.arange() {start = 1, end = S+1} : i64[S]
    return %w, %r
  }
}
// CHECK:
module {
  func @forward(%x: f32[B, 4], %w: f32[4, 4]) -> (f32[B, 4], f32[B, 2], f32[B, 2]) attributes {donate = [1], note = "a \"quoted\"\nline", weird = {"a b" = none}} {
    %f = cinn.fusion() : f32[B, 4] {
      %a = llm.exp(%x) : f32[B, 4]
      %b = llm.mul(%a, %x) : f32[B, 4]
      cinn.yield(%b)
    }
    %k = cinn.kernel(%f, %w) {kernel = "fused_0", grid = [4, 1], tuned = true, scale = -0.0} : f32[B, 4]
    %r = dist.reshard(%k) {mesh = #mesh<[2, 2], ["dp", "tp"]>, placements = [#shard<0>, #replicate<>]} : f32[B, 4]
    %lo, %hi = llm.split(%r) {sections = [2, 2], axis = 1} : f32[B, 2], f32[B, 2]
    %sent = dist.send(%lo) {peer = 1} : f32[B, 2]
    return %r, %lo, %hi
  }
  func @consts() -> (f32[2, 3], i64[4], bool[2], f32[], bf16[2], f32[20]) {
    %a = builtin.constant() {value = dense<f32[2, 3] [0.1, -2.5, inf, -inf, nan, 1e-30]>} : f32[2, 3]
    %i = builtin.constant() {value = dense<i64[4] [0, -1, 9223372036854775807, -9223372036854775808]>} : i64[4]
    %m = builtin.constant() {value = dense<bool[2] [true, false]>} : bool[2]
    %s = builtin.constant() {value = dense<f32[] [3.0]>} : f32[]
    %h = builtin.constant() {value = dense<bf16[2] [0.100098, 65280.0]>} : bf16[2]
    %big = builtin.constant() {value = dense_resource<r0>} : f32[20]
    return %a, %i, %m, %s, %h, %big
  }
  func @params() -> (f32[S+1, 8], i64[S]) {
    %w = builtin.parameter() {name = "layers.0.mlp.weight"} : f32[S+1, 8]
    %r = llm.arange() {start = 1, end = S+1} : i64[S]
    return %w, %r
  }
}
resources {
  r0 = dense<f32[20] 0x000000000000803F0000004000004040000080400000A0400000C0400000E040000000410000104100002041000030410000404100005041000060410000704100008041000088410000904100009841>
}
