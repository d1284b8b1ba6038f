// RUN: canonicalize
// x*1, 1*x, x/1, x+0, 0+x, x-0 and neg(neg(x)) become x; a broadcast that grows x keeps the op.
module {
  func @main(%x: f32[2, 3], %v: f32[3]) -> (f32[2, 3], f32[2, 3]) {
    %one = builtin.constant() {value = dense<f32[] [1.0]>} : f32[]
    %zeros = llm.zeros_like(%x) : f32[2, 3]
    %a = llm.mul(%x, %one) : f32[2, 3]
    %b = llm.mul(%one, %a) : f32[2, 3]
    %c = llm.div(%b, %one) : f32[2, 3]
    %d = llm.add(%zeros, %c) : f32[2, 3]
    %e = llm.sub(%d, %zeros) : f32[2, 3]
    %f = llm.neg(%e) : f32[2, 3]
    %g = llm.neg(%f) : f32[2, 3]
    %grow = llm.add(%v, %zeros) : f32[2, 3]
    return %g, %grow
  }
}
// CHECK:
module {
  func @main(%x: f32[2, 3], %v: f32[3]) -> (f32[2, 3], f32[2, 3]) {
    %zeros = llm.zeros_like(%x) : f32[2, 3]
    %grow = llm.add(%v, %zeros) : f32[2, 3]
    return %x, %grow
  }
}
