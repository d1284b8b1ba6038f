// RUN: fuse-patterns
// matmul + bias becomes linear (either add order; a transpose of a [in, out] weight is made);
// a bias that is not 1-D, or a matmul result used elsewhere, blocks the rule.
module {
  func @main(%x: f32[B, 4], %wt: f32[8, 4], %w: f32[4, 8], %b: f32[8], %b2: f32[B, 8]) -> (f32[B, 8], f32[B, 8], f32[B, 8], f32[B, 8], f32[B, 8]) {
    %m1 = llm.matmul(%x, %wt) {transpose_y = true} : f32[B, 8]
    %y1 = llm.add(%b, %m1) : f32[B, 8]
    %m2 = llm.matmul(%x, %w) : f32[B, 8]
    %y2 = llm.add(%m2, %b) : f32[B, 8]
    %m3 = llm.matmul(%x, %w) : f32[B, 8]
    %y3 = llm.add(%m3, %b2) : f32[B, 8]
    %m4 = llm.matmul(%x, %w) : f32[B, 8]
    %y4 = llm.add(%m4, %b) : f32[B, 8]
    return %y1, %y2, %y3, %y4, %m4
  }
}
// CHECK:
module {
  func @main(%x: f32[B, 4], %wt: f32[8, 4], %w: f32[4, 8], %b: f32[8], %b2: f32[B, 8]) -> (f32[B, 8], f32[B, 8], f32[B, 8], f32[B, 8], f32[B, 8]) {
    %y1 = llm.linear(%x, %wt, %b) : f32[B, 8]
    %0 = llm.transpose(%w) {perm = [1, 0]} : f32[8, 4]
    %y2 = llm.linear(%x, %0, %b) : f32[B, 8]
    %m3 = llm.matmul(%x, %w) : f32[B, 8]
    %y3 = llm.add(%m3, %b2) : f32[B, 8]
    %m4 = llm.matmul(%x, %w) : f32[B, 8]
    %y4 = llm.add(%m4, %b) : f32[B, 8]
    return %y1, %y2, %y3, %y4, %m4
  }
}
