// RUN: canonicalize,cse
// Constants move to the right of commutative ops, so CSE sees one form.
module {
  func @main(%x: f32[3]) -> (f32[3], f32[3]) {
    %c = builtin.constant() {value = dense<f32[3] [1.0, 2.0, 3.0]>} : f32[3]
    %a = llm.mul(%c, %x) : f32[3]
    %b = llm.mul(%x, %c) : f32[3]
    %s = llm.maximum(%c, %x) : f32[3]
    return %a, %s
  }
}
// CHECK:
module {
  func @main(%x: f32[3]) -> (f32[3], f32[3]) {
    %c = builtin.constant() {value = dense<f32[3] [1.0, 2.0, 3.0]>} : f32[3]
    %a = llm.mul(%x, %c) : f32[3]
    %s = llm.maximum(%x, %c) : f32[3]
    return %a, %s
  }
}
