// RUN: cse
// Equal pure ops merge (operands in either order for commutative ops); different attributes,
// and non-commutative operand orders stay apart.
module {
  func @main(%x: f32[2, 3], %y: f32[2, 3]) -> (f32[2, 3], f32[2, 3], f32[2, 3], f32[2, 3], f32[3, 2], f32[3, 2]) {
    %a1 = llm.add(%x, %y) : f32[2, 3]
    %a2 = llm.add(%y, %x) : f32[2, 3]
    %s1 = llm.sub(%x, %y) : f32[2, 3]
    %s2 = llm.sub(%y, %x) : f32[2, 3]
    %t1 = llm.transpose(%x) {perm = [1, 0]} : f32[3, 2]
    %t2 = llm.transpose(%x) {perm = [1, 0]} : f32[3, 2]
    %e1 = llm.exp(%a1) : f32[2, 3]
    %e2 = llm.exp(%a2) : f32[2, 3]
    %p1 = llm.softmax(%e1) {axis = 0} : f32[2, 3]
    %p2 = llm.softmax(%e2) : f32[2, 3]
    return %a2, %s1, %s2, %e2, %t1, %t2
  }
}
// CHECK:
module {
  func @main(%x: f32[2, 3], %y: f32[2, 3]) -> (f32[2, 3], f32[2, 3], f32[2, 3], f32[2, 3], f32[3, 2], f32[3, 2]) {
    %a1 = llm.add(%x, %y) : f32[2, 3]
    %s1 = llm.sub(%x, %y) : f32[2, 3]
    %s2 = llm.sub(%y, %x) : f32[2, 3]
    %t1 = llm.transpose(%x) {perm = [1, 0]} : f32[3, 2]
    %e1 = llm.exp(%a1) : f32[2, 3]
    %p1 = llm.softmax(%e1) {axis = 0} : f32[2, 3]
    %p2 = llm.softmax(%e1) : f32[2, 3]
    return %a1, %s1, %s2, %e1, %t1, %t1
  }
}
