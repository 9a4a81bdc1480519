// The table row an Embedding id names, clamped into [0, V): the float is clamped first (so its
// conversion is defined for any finite id), then the integer (a NaN converts to anything).
#ifndef VKFLOW_EMBEDDING_ROW_GLSL
#define VKFLOW_EMBEDDING_ROW_GLSL

uint table_row(float id, uint rows) {
    return min(uint(clamp(id, 0.0, float(rows - 1u))), rows - 1u);
}

#endif
