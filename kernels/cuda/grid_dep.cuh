// Programmatic dependent launch (sm_90 and later; no-ops elsewhere, and in a kernel launched
// without the attribute). Included by attention.cu and attention_sm90.cu; _build.py inlines
// it. grid_dep_launch: the next kernel of the stream, where it was launched as a programmatic
// dependent (_build.launch_dependent), may start before this one ends. grid_dep_wait: wait
// until the kernel before this one has ended and its writes are visible.

__device__ __forceinline__ void grid_dep_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
