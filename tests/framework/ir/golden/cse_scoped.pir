// RUN: cse,dce
// A fusion group may reuse an equal op from before it; ops after the group never reuse an op
// from inside it (it does not dominate them).
module {
  func @main(%x: f32[4], %y: f32[4]) -> (f32[4], f32[4], f32[4]) {
    %a = llm.mul(%x, %y) : f32[4]
    %f = cinn.fusion() : f32[4] {
      %b = llm.mul(%y, %x) : f32[4]
      %c = llm.tanh(%b) : f32[4]
      cinn.yield(%c)
    }
    %d = llm.tanh(%a) : f32[4]
    return %a, %f, %d
  }
}
// CHECK:
module {
  func @main(%x: f32[4], %y: f32[4]) -> (f32[4], f32[4], f32[4]) {
    %a = llm.mul(%x, %y) : f32[4]
    %f = cinn.fusion() : f32[4] {
      %c = llm.tanh(%a) : f32[4]
      cinn.yield(%c)
    }
    %d = llm.tanh(%a) : f32[4]
    return %a, %f, %d
  }
}
