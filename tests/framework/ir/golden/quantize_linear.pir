// RUN: quantize-linear
// A linear / tiled_linear whose weight is dequantize(q, s[, z]) reads the codes: quant_linear (a bias
// becomes an add; tiled_linear's rows carry over); a dequantized weight with other users stays.
module {
  func @main(%x: f32[B, 8], %q: u8[4, 4], %s: f32[4, 2], %z: u8[4, 2], %b: f32[4], %q8: i8[4, 8], %s8: f32[4, 1]) -> (f32[B, 4], f32[B, 4], f32[B, 4], f32[4, 8]) {
    %w = llm.dequantize(%q, %s, %z) {group_size = 4} : f32[4, 8]
    %y = llm.linear(%x, %w, %b) : f32[B, 4]
    %w8 = llm.dequantize(%q8, %s8) {bits = 8, group_size = -1} : f32[4, 8]
    %t = llm.tiled_linear(%x, %w8) {rows = 1} : f32[B, 4]
    %k = llm.dequantize(%q, %s) {group_size = 4} : f32[4, 8]
    %u = llm.linear(%x, %k) : f32[B, 4]
    return %y, %t, %u, %k
  }
}
// CHECK:
module {
  func @main(%x: f32[B, 8], %q: u8[4, 4], %s: f32[4, 2], %z: u8[4, 2], %b: f32[4], %q8: i8[4, 8], %s8: f32[4, 1]) -> (f32[B, 4], f32[B, 4], f32[B, 4], f32[4, 8]) {
    %0 = llm.quant_linear(%x, %q, %s, %z) {group_size = 4} : f32[B, 4]
    %y = llm.add(%0, %b) : f32[B, 4]
    %t = llm.quant_linear(%x, %q8, %s8) {bits = 8, group_size = -1, rows = 1} : f32[B, 4]
    %k = llm.dequantize(%q, %s) {group_size = 4} : f32[4, 8]
    %u = llm.linear(%x, %k) : f32[B, 4]
    return %y, %t, %u, %k
  }
}
