// RUN: fuse-patterns
// silu(gate) * up becomes swiglu(gate, up) in either order; a broadcast up, or a silu used
// elsewhere, blocks the rule.
module {
  func @main(%g: f32[B, 16], %u: f32[B, 16], %v: f32[16]) -> (f32[B, 16], f32[B, 16], f32[B, 16], f32[B, 16], f32[B, 16]) {
    %s1 = llm.silu(%g) : f32[B, 16]
    %y1 = llm.mul(%s1, %u) : f32[B, 16]
    %s2 = llm.silu(%u) : f32[B, 16]
    %y2 = llm.mul(%g, %s2) : f32[B, 16]
    %s3 = llm.silu(%g) : f32[B, 16]
    %y3 = llm.mul(%s3, %v) : f32[B, 16]
    %s4 = llm.silu(%u) : f32[B, 16]
    %y4 = llm.mul(%s4, %g) : f32[B, 16]
    return %y1, %y2, %y3, %y4, %s4
  }
}
// CHECK:
module {
  func @main(%g: f32[B, 16], %u: f32[B, 16], %v: f32[16]) -> (f32[B, 16], f32[B, 16], f32[B, 16], f32[B, 16], f32[B, 16]) {
    %y1 = llm.swiglu(%g, %u) : f32[B, 16]
    %y2 = llm.swiglu(%u, %g) : f32[B, 16]
    %s3 = llm.silu(%g) : f32[B, 16]
    %y3 = llm.mul(%s3, %v) : f32[B, 16]
    %s4 = llm.silu(%u) : f32[B, 16]
    %y4 = llm.mul(%s4, %g) : f32[B, 16]
    return %y1, %y2, %y3, %y4, %s4
  }
}
