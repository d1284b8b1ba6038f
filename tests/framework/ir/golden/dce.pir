// RUN: dce
// Dead pure ops go, whole chains in one sweep; used values stay.
module {
  func @main(%x: f32[B, 4], %w: f32[4, 4]) -> (f32[B, 4]) {
    %h = llm.matmul(%x, %w) : f32[B, 4]
    %dead1 = llm.exp(%h) : f32[B, 4]
    %dead2 = llm.add(%dead1, %dead1) : f32[B, 4]
    %dead3 = llm.sum(%dead2) : f32[]
    %c = builtin.constant() {value = dense<f32[2] [1.0, 2.0]>} : f32[2]
    %y = llm.relu(%h) : f32[B, 4]
    return %y
  }
}
// CHECK:
module {
  func @main(%x: f32[B, 4], %w: f32[4, 4]) -> (f32[B, 4]) {
    %h = llm.matmul(%x, %w) : f32[B, 4]
    %y = llm.relu(%h) : f32[B, 4]
    return %y
  }
}
