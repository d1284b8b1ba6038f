// RUN: cinn-fuse
// The AdamW update of a parameter: one group, three outputs (parameter and both moments); the
// bias corrections are scalars computed inside it (hoisted out of the loops when lowered).
module {
  func @main(%arg0: f32[64, 32], %arg1: f32[64, 32], %arg2: f32[64, 32], %arg3: f32[64, 32], %arg4: f64[], %arg5: i64[]) -> (f32[64, 32], f32[64, 32], f32[64, 32]) {
    %0 = llm.cast(%arg4) {dtype = f32} : f32[]
    %1 = llm.cast(%arg5) {dtype = f32} : f32[]
    %2 = builtin.constant() {value = dense<f32[] [0.1]>} : f32[]
    %3 = llm.mul(%0, %2) : f32[]
    %4 = builtin.constant() {value = dense<f32[] [1.0]>} : f32[]
    %5 = llm.sub(%4, %3) : f32[]
    %6 = llm.mul(%arg0, %5) : f32[64, 32]
    %7 = builtin.constant() {value = dense<f32[] [0.9]>} : f32[]
    %8 = llm.mul(%arg2, %7) : f32[64, 32]
    %9 = builtin.constant() {value = dense<f32[] [0.1]>} : f32[]
    %10 = llm.mul(%arg1, %9) : f32[64, 32]
    %11 = llm.add(%8, %10) : f32[64, 32]
    %12 = builtin.constant() {value = dense<f32[] [0.95]>} : f32[]
    %13 = llm.mul(%arg3, %12) : f32[64, 32]
    %14 = llm.mul(%arg1, %arg1) : f32[64, 32]
    %15 = builtin.constant() {value = dense<f32[] [0.05]>} : f32[]
    %16 = llm.mul(%14, %15) : f32[64, 32]
    %17 = llm.add(%13, %16) : f32[64, 32]
    %18 = builtin.constant() {value = dense<f32[] [0.9]>} : f32[]
    %19 = llm.pow(%18, %1) : f32[]
    %20 = builtin.constant() {value = dense<f32[] [1.0]>} : f32[]
    %21 = llm.sub(%20, %19) : f32[]
    %22 = builtin.constant() {value = dense<f32[] [0.95]>} : f32[]
    %23 = llm.pow(%22, %1) : f32[]
    %24 = builtin.constant() {value = dense<f32[] [1.0]>} : f32[]
    %25 = llm.sub(%24, %23) : f32[]
    %26 = llm.div(%0, %21) : f32[]
    %27 = llm.mul(%26, %11) : f32[64, 32]
    %28 = llm.sqrt(%17) : f32[64, 32]
    %29 = llm.sqrt(%25) : f32[]
    %30 = llm.div(%28, %29) : f32[64, 32]
    %31 = builtin.constant() {value = dense<f32[] [1e-08]>} : f32[]
    %32 = llm.add(%30, %31) : f32[64, 32]
    %33 = llm.div(%27, %32) : f32[64, 32]
    %34 = llm.sub(%6, %33) : f32[64, 32]
    return %34, %11, %17
  }
}
// CHECK:
module {
  func @main(%arg0: f32[64, 32], %arg1: f32[64, 32], %arg2: f32[64, 32], %arg3: f32[64, 32], %arg4: f64[], %arg5: i64[]) -> (f32[64, 32], f32[64, 32], f32[64, 32]) {
    %0, %1, %2 = cinn.fusion(%arg4, %arg5, %arg0, %arg2, %arg1, %arg3) {name = "mul_sub_add"} : f32[64, 32], f32[64, 32], f32[64, 32] {
      %3 = llm.cast(%arg4) {dtype = f32} : f32[]
      %4 = llm.cast(%arg5) {dtype = f32} : f32[]
      %5 = builtin.constant() {value = dense<f32[] [0.1]>} : f32[]
      %6 = llm.mul(%3, %5) : f32[]
      %7 = builtin.constant() {value = dense<f32[] [1.0]>} : f32[]
      %8 = llm.sub(%7, %6) : f32[]
      %9 = llm.mul(%arg0, %8) : f32[64, 32]
      %10 = builtin.constant() {value = dense<f32[] [0.9]>} : f32[]
      %11 = llm.mul(%arg2, %10) : f32[64, 32]
      %12 = llm.mul(%arg1, %5) : f32[64, 32]
      %13 = llm.add(%11, %12) : f32[64, 32]
      %14 = builtin.constant() {value = dense<f32[] [0.95]>} : f32[]
      %15 = llm.mul(%arg3, %14) : f32[64, 32]
      %16 = llm.mul(%arg1, %arg1) : f32[64, 32]
      %17 = builtin.constant() {value = dense<f32[] [0.05]>} : f32[]
      %18 = llm.mul(%16, %17) : f32[64, 32]
      %19 = llm.add(%15, %18) : f32[64, 32]
      %20 = llm.pow(%10, %4) : f32[]
      %21 = llm.sub(%7, %20) : f32[]
      %22 = llm.pow(%14, %4) : f32[]
      %23 = llm.sub(%7, %22) : f32[]
      %24 = llm.div(%3, %21) : f32[]
      %25 = llm.mul(%24, %13) : f32[64, 32]
      %26 = llm.sqrt(%19) : f32[64, 32]
      %27 = llm.sqrt(%23) : f32[]
      %28 = llm.div(%26, %27) : f32[64, 32]
      %29 = builtin.constant() {value = dense<f32[] [1e-08]>} : f32[]
      %30 = llm.add(%28, %29) : f32[64, 32]
      %31 = llm.div(%25, %30) : f32[64, 32]
      %32 = llm.sub(%9, %31) : f32[64, 32]
      cinn.yield(%13, %19, %32)
    }
    return %2, %0, %1
  }
}
