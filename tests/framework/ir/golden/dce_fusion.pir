// RUN: dce
// Inside a fusion group dead ops go too; a fusion group whose results are unused goes as a whole.
module {
  func @main(%x: f32[8], %y: f32[8]) -> (f32[8]) {
    %f = cinn.fusion() : f32[8] {
      %a = llm.add(%x, %y) : f32[8]
      %unused = llm.mul(%a, %a) : f32[8]
      %b = llm.exp(%a) : f32[8]
      cinn.yield(%b)
    }
    %g = cinn.fusion() : f32[8] {
      %c = llm.sub(%x, %y) : f32[8]
      cinn.yield(%c)
    }
    return %f
  }
}
// CHECK:
module {
  func @main(%x: f32[8], %y: f32[8]) -> (f32[8]) {
    %f = cinn.fusion() : f32[8] {
      %a = llm.add(%x, %y) : f32[8]
      %b = llm.exp(%a) : f32[8]
      cinn.yield(%b)
    }
    return %f
  }
}
