// RUN: cse,dce
// Communication is never merged or dropped, even when equal or unused.
module {
  func @main(%x: f32[2, 4]) -> (f32[2, 4]) {
    %r1 = dist.all_reduce(%x) {group = [0, 1]} : f32[2, 4]
    %r2 = dist.all_reduce(%x) {group = [0, 1]} : f32[2, 4]
    %unused = dist.all_gather(%x) {group = [0, 1], axis = 0, sizes = [2, 2]} : f32[4, 4]
    %y = llm.add(%r1, %r2) : f32[2, 4]
    return %y
  }
}
// CHECK:
module {
  func @main(%x: f32[2, 4]) -> (f32[2, 4]) {
    %r1 = dist.all_reduce(%x) {group = [0, 1]} : f32[2, 4]
    %r2 = dist.all_reduce(%x) {group = [0, 1]} : f32[2, 4]
    %unused = dist.all_gather(%x) {group = [0, 1], axis = 0, sizes = [2, 2]} : f32[4, 4]
    %y = llm.add(%r1, %r2) : f32[2, 4]
    return %y
  }
}
