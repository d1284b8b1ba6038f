// RUN: cinn-fuse
// Cross entropy with its gradient: the row max, the sum of exponentials, the log-probability
// of the label and (softmax - one_hot) * scale are one group; the mean over rows is another.
module {
  func @main(%arg0: f32[N, 10], %arg1: i64[N]) -> (f32[], f32[N, 10]) {
    %0 = llm.cross_entropy(%arg0, %arg1) : f32[]
    %1 = llm.ones_like(%0) : f32[]
    %2 = builtin.constant() {value = dense<i64[] [-100]>} : i64[]
    %3 = llm.not_equal(%arg1, %2) : bool[N]
    %4 = builtin.constant() {value = dense<i64[] [0]>} : i64[]
    %5 = llm.where(%3, %arg1, %4) : i64[N]
    %6 = llm.one_hot(%5) {num_classes = 10} : f32[N, 10]
    %7 = llm.cast(%3) {dtype = f32} : f32[N]
    %8 = llm.sum(%7) : f32[]
    %9 = llm.div(%1, %8) : f32[]
    %10 = llm.mul(%7, %9) : f32[N]
    %11 = llm.unsqueeze(%10) {axis = [-1]} : f32[N, 1]
    %12 = llm.softmax(%arg0) : f32[N, 10]
    %13 = llm.sub(%12, %6) : f32[N, 10]
    %14 = llm.mul(%13, %11) : f32[N, 10]
    return %0, %14
  }
}
// CHECK:
module {
  func @main(%arg0: f32[N, 10], %arg1: i64[N]) -> (f32[], f32[N, 10]) {
    %0, %1 = cinn.fusion(%arg1) {name = "cross_entropy"} : f32[], f32[N] {
      %2 = builtin.constant() {value = dense<i64[] [-100]>} : i64[]
      %3 = llm.not_equal(%arg1, %2) : bool[N]
      %4 = llm.cast(%3) {dtype = f32} : f32[N]
      %5 = llm.sum(%4) : f32[]
      %6 = llm.full() {shape = [], value = 1.0} : f32[]
      %7 = llm.div(%6, %5) : f32[]
      %8 = llm.mul(%4, %7) : f32[N]
      cinn.yield(%5, %8)
    }
    %9, %10 = cinn.fusion(%arg1, %arg0, %1) {name = "cross_entropy+softmax"} : f32[N], f32[N, 10] {
      %11 = builtin.constant() {value = dense<i64[] [-100]>} : i64[]
      %12 = llm.not_equal(%arg1, %11) : bool[N]
      %13 = builtin.constant() {value = dense<i64[] [0]>} : i64[]
      %14 = llm.where(%12, %arg1, %13) : i64[N]
      %15 = llm.unsqueeze(%14) {axis = [-1]} : i64[N, 1]
      %16 = llm.arange() {end = 10} : i64[10]
      %17 = llm.equal(%15, %16) : bool[N, 10]
      %18 = llm.cast(%17) {dtype = f32} : f32[N, 10]
      %19 = llm.cast(%12) {dtype = f32} : f32[N]
      %20 = llm.max(%arg0) {axis = [-1], keepdim = true} : f32[N, 1]
      %21 = llm.sub(%arg0, %20) : f32[N, 10]
      %22 = llm.exp(%21) : f32[N, 10]
      %23 = llm.sum(%22) {axis = [-1], keepdim = true} : f32[N, 1]
      %24 = llm.log(%23) : f32[N, 1]
      %25 = llm.sub(%21, %24) : f32[N, 10]
      %26 = llm.mul(%25, %18) : f32[N, 10]
      %27 = llm.sum(%26) {axis = [-1]} : f32[N]
      %28 = llm.neg(%27) : f32[N]
      %29 = llm.mul(%28, %19) : f32[N]
      %30 = llm.unsqueeze(%1) {axis = [-1]} : f32[N, 1]
      %31 = llm.div(%22, %23) : f32[N, 10]
      %32 = llm.sub(%31, %18) : f32[N, 10]
      %33 = llm.mul(%32, %30) : f32[N, 10]
      cinn.yield(%29, %33)
    }
    %34 = cinn.fusion(%9, %0) {name = "cross_entropy"} : f32[] {
      %35 = llm.sum(%9) : f32[]
      %36 = llm.div(%35, %0) : f32[]
      cinn.yield(%36)
    }
    return %34, %10
  }
}
