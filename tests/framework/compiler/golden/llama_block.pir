// RUN: cinn-fuse
// A Llama decoder block (forward). Each RMSNorm is one group (the second with the residual
// add); rotary is one group per head set; the attention softmax with its causal mask is one
// group; matmuls stay outside groups or head an elementwise epilogue (swiglu, residual add).
module {
  func @main(%arg0: f32[B, S, 16], %arg1: i64[B, S], %rope_cos: f64[32, 8], %rope_sin: f64[32, 8], %input_layernorm_weight: f32[16], %self_attn_q_proj_weight: f32[16, 16], %self_attn_k_proj_weight: f32[8, 16], %self_attn_v_proj_weight: f32[8, 16], %self_attn_o_proj_weight: f32[16, 16], %post_attention_layernorm_weight: f32[16], %mlp_gate_proj_weight: f32[24, 16], %mlp_up_proj_weight: f32[24, 16], %mlp_down_proj_weight: f32[16, 24]) -> (f32[B, S, 16]) {
    %0 = llm.cast(%rope_cos) {dtype = f32} : f32[32, 8]
    %1 = llm.cast(%rope_sin) {dtype = f32} : f32[32, 8]
    %2 = llm.rms_norm(%arg0, %input_layernorm_weight) {eps = 1e-05} : f32[B, S, 16]
    %3 = llm.linear(%2, %self_attn_q_proj_weight) : f32[B, S, 16]
    %4 = llm.reshape(%3) {shape = [B, S, 2, 8]} : f32[B, S, 2, 8]
    %5 = llm.transpose(%4) {perm = [0, 2, 1, 3]} : f32[B, 2, S, 8]
    %6 = llm.linear(%2, %self_attn_k_proj_weight) : f32[B, S, 8]
    %7 = llm.reshape(%6) {shape = [B, S, 1, 8]} : f32[B, S, 1, 8]
    %8 = llm.transpose(%7) {perm = [0, 2, 1, 3]} : f32[B, 1, S, 8]
    %9 = llm.linear(%2, %self_attn_v_proj_weight) : f32[B, S, 8]
    %10 = llm.reshape(%9) {shape = [B, S, 1, 8]} : f32[B, S, 1, 8]
    %11 = llm.transpose(%10) {perm = [0, 2, 1, 3]} : f32[B, 1, S, 8]
    %12 = llm.rotary_embedding(%5, %0, %1, %arg1) : f32[B, 2, S, 8]
    %13 = llm.rotary_embedding(%8, %0, %1, %arg1) : f32[B, 1, S, 8]
    %14 = llm.scaled_dot_product_attention(%12, %13, %11) {is_causal = true} : f32[B, 2, S, 8]
    %15 = llm.transpose(%14) {perm = [0, 2, 1, 3]} : f32[B, S, 2, 8]
    %16 = llm.reshape(%15) {shape = [B, S, 16]} : f32[B, S, 16]
    %17 = llm.linear(%16, %self_attn_o_proj_weight) : f32[B, S, 16]
    %18 = llm.add(%arg0, %17) : f32[B, S, 16]
    %19 = llm.rms_norm(%18, %post_attention_layernorm_weight) {eps = 1e-05} : f32[B, S, 16]
    %20 = llm.linear(%19, %mlp_gate_proj_weight) : f32[B, S, 24]
    %21 = llm.linear(%19, %mlp_up_proj_weight) : f32[B, S, 24]
    %22 = llm.swiglu(%20, %21) : f32[B, S, 24]
    %23 = llm.linear(%22, %mlp_down_proj_weight) : f32[B, S, 16]
    %24 = llm.add(%18, %23) : f32[B, S, 16]
    return %24
  }
}
// CHECK:
module {
  func @main(%arg0: f32[B, S, 16], %arg1: i64[B, S], %rope_cos: f64[32, 8], %rope_sin: f64[32, 8], %input_layernorm_weight: f32[16], %self_attn_q_proj_weight: f32[16, 16], %self_attn_k_proj_weight: f32[8, 16], %self_attn_v_proj_weight: f32[8, 16], %self_attn_o_proj_weight: f32[16, 16], %post_attention_layernorm_weight: f32[16], %mlp_gate_proj_weight: f32[24, 16], %mlp_up_proj_weight: f32[24, 16], %mlp_down_proj_weight: f32[16, 24]) -> (f32[B, S, 16]) {
    %0 = cinn.fusion(%rope_cos) {name = "cast"} : f32[32, 8] {
      %1 = llm.cast(%rope_cos) {dtype = f32} : f32[32, 8]
      cinn.yield(%1)
    }
    %2 = cinn.fusion(%rope_sin) {name = "cast"} : f32[32, 8] {
      %3 = llm.cast(%rope_sin) {dtype = f32} : f32[32, 8]
      cinn.yield(%3)
    }
    %4 = cinn.fusion(%arg0, %input_layernorm_weight) {name = "rms_norm"} : f32[B, S, 16] {
      %5 = llm.mul(%arg0, %arg0) : f32[B, S, 16]
      %6 = llm.mean(%5) {axis = [-1], keepdim = true} : f32[B, S, 1]
      %7 = builtin.constant() {value = dense<f32[] [1e-05]>} : f32[]
      %8 = llm.add(%6, %7) : f32[B, S, 1]
      %9 = llm.rsqrt(%8) : f32[B, S, 1]
      %10 = llm.mul(%arg0, %9) : f32[B, S, 16]
      %11 = llm.mul(%10, %input_layernorm_weight) : f32[B, S, 16]
      cinn.yield(%11)
    }
    %12 = llm.matmul(%4, %self_attn_q_proj_weight) {transpose_y = true} : f32[B, S, 16]
    %13 = llm.matmul(%4, %self_attn_k_proj_weight) {transpose_y = true} : f32[B, S, 8]
    %14 = llm.matmul(%4, %self_attn_v_proj_weight) {transpose_y = true} : f32[B, S, 8]
    %15 = llm.reshape(%14) {shape = [B, S, 1, 8]} : f32[B, S, 1, 8]
    %16 = llm.transpose(%15) {perm = [0, 2, 1, 3]} : f32[B, 1, S, 8]
    %17 = llm.reshape(%arg1) {shape = [-1]} : i64[B*S]
    %18 = llm.index_select(%0, %17) : f32[B*S, 8]
    %19 = llm.index_select(%2, %17) : f32[B*S, 8]
    %20 = cinn.fusion(%12, %18, %19) {name = "rotary_embedding"} : f32[B, 2, S, 8] {
      %21 = llm.reshape(%12) {shape = [B, S, 2, 8]} : f32[B, S, 2, 8]
      %22 = llm.transpose(%21) {perm = [0, 2, 1, 3]} : f32[B, 2, S, 8]
      %23 = llm.reshape(%18) {shape = [B, S, 8]} : f32[B, S, 8]
      %24 = llm.unsqueeze(%23) {axis = [1]} : f32[B, 1, S, 8]
      %25 = llm.reshape(%19) {shape = [B, S, 8]} : f32[B, S, 8]
      %26 = llm.unsqueeze(%25) {axis = [1]} : f32[B, 1, S, 8]
      %27 = llm.mul(%22, %24) : f32[B, 2, S, 8]
      %28 = llm.slice(%22) {axes = [-1], starts = [0], ends = [4]} : f32[B, 2, S, 4]
      %29 = llm.slice(%22) {axes = [-1], starts = [4], ends = [8]} : f32[B, 2, S, 4]
      %30 = llm.neg(%29) : f32[B, 2, S, 4]
      %31 = llm.concat(%30, %28) {axis = -1} : f32[B, 2, S, 8]
      %32 = llm.mul(%31, %26) : f32[B, 2, S, 8]
      %33 = llm.add(%27, %32) : f32[B, 2, S, 8]
      cinn.yield(%33)
    }
    %34 = cinn.fusion(%13, %18, %19) {name = "rotary_embedding"} : f32[B, 1, S, 8] {
      %35 = llm.reshape(%13) {shape = [B, S, 1, 8]} : f32[B, S, 1, 8]
      %36 = llm.transpose(%35) {perm = [0, 2, 1, 3]} : f32[B, 1, S, 8]
      %37 = llm.reshape(%18) {shape = [B, S, 8]} : f32[B, S, 8]
      %38 = llm.unsqueeze(%37) {axis = [1]} : f32[B, 1, S, 8]
      %39 = llm.reshape(%19) {shape = [B, S, 8]} : f32[B, S, 8]
      %40 = llm.unsqueeze(%39) {axis = [1]} : f32[B, 1, S, 8]
      %41 = llm.mul(%36, %38) : f32[B, 1, S, 8]
      %42 = llm.slice(%36) {axes = [-1], starts = [0], ends = [4]} : f32[B, 1, S, 4]
      %43 = llm.slice(%36) {axes = [-1], starts = [4], ends = [8]} : f32[B, 1, S, 4]
      %44 = llm.neg(%43) : f32[B, 1, S, 4]
      %45 = llm.concat(%44, %42) {axis = -1} : f32[B, 1, S, 8]
      %46 = llm.mul(%45, %40) : f32[B, 1, S, 8]
      %47 = llm.add(%41, %46) : f32[B, 1, S, 8]
      cinn.yield(%47)
    }
    %48 = llm.scaled_dot_product_attention(%20, %34, %16) {is_causal = true} : f32[B, 2, S, 8]
    %49 = llm.transpose(%48) {perm = [0, 2, 1, 3]} : f32[B, S, 2, 8]
    %50 = llm.reshape(%49) {shape = [B, S, 16]} : f32[B, S, 16]
    %51 = llm.matmul(%50, %self_attn_o_proj_weight) {transpose_y = true} : f32[B, S, 16]
    %52 = cinn.fusion(%arg0, %51, %post_attention_layernorm_weight) {name = "rms_norm"} : f32[B, S, 16] {
      %53 = builtin.constant() {value = dense<f32[] [1e-05]>} : f32[]
      %54 = llm.add(%arg0, %51) : f32[B, S, 16]
      %55 = llm.mul(%54, %54) : f32[B, S, 16]
      %56 = llm.mean(%55) {axis = [-1], keepdim = true} : f32[B, S, 1]
      %57 = llm.add(%56, %53) : f32[B, S, 1]
      %58 = llm.rsqrt(%57) : f32[B, S, 1]
      %59 = llm.mul(%54, %58) : f32[B, S, 16]
      %60 = llm.mul(%59, %post_attention_layernorm_weight) : f32[B, S, 16]
      cinn.yield(%60)
    }
    %61 = llm.matmul(%52, %mlp_gate_proj_weight) {transpose_y = true} : f32[B, S, 24]
    %62 = cinn.fusion(%52, %mlp_up_proj_weight, %61) {name = "swiglu+linear"} : f32[B, S, 24] {
      %63 = llm.matmul(%52, %mlp_up_proj_weight) {transpose_y = true} : f32[B, S, 24]
      %64 = llm.sigmoid(%61) : f32[B, S, 24]
      %65 = llm.mul(%61, %64) : f32[B, S, 24]
      %66 = llm.mul(%65, %63) : f32[B, S, 24]
      cinn.yield(%66)
    }
    %67 = cinn.fusion(%62, %mlp_down_proj_weight, %arg0, %51) {name = "linear"} : f32[B, S, 16] {
      %68 = llm.matmul(%62, %mlp_down_proj_weight) {transpose_y = true} : f32[B, S, 16]
      %69 = llm.add(%arg0, %51) : f32[B, S, 16]
      %70 = llm.add(%69, %68) : f32[B, S, 16]
      cinn.yield(%70)
    }
    return %67
  }
}
