// RUN: cse,dce
// Communication is never merged or dropped, even when equal or unused.
module {
  func @main(%x: f32[B, 4]) -> (f32[B, 4]) {
    %r1 = dist.all_reduce(%x) {mesh = [2], placements = [#partial<"sum">], reduce = "sum"} : f32[B, 4]
    %r2 = dist.all_reduce(%x) {mesh = [2], placements = [#partial<"sum">], reduce = "sum"} : f32[B, 4]
    %unused = dist.all_gather(%x) {mesh = [2], placements = [#shard<0>]} : f32[2*B, 4]
    %y = llm.add(%r1, %r2) : f32[B, 4]
    return %y
  }
}
// CHECK:
module {
  func @main(%x: f32[B, 4]) -> (f32[B, 4]) {
    %r1 = dist.all_reduce(%x) {mesh = [2], placements = [#partial<"sum">], reduce = "sum"} : f32[B, 4]
    %r2 = dist.all_reduce(%x) {mesh = [2], placements = [#partial<"sum">], reduce = "sum"} : f32[B, 4]
    %unused = dist.all_gather(%x) {mesh = [2], placements = [#shard<0>]} : f32[2*B, 4]
    %y = llm.add(%r1, %r2) : f32[B, 4]
    return %y
  }
}
