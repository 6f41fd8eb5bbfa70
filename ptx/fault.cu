// Deliberately faults with CUDA_ERROR_ILLEGAL_ADDRESS, whatever `p` is: the store goes to
// `p` with bit 62 set, an address above every GPU virtual address space (alignment kept).
// The context is poisoned afterwards (a sticky error): use it only in error tests.
extern "C" __global__ void fault(int* p)
{
    volatile int* bad = (volatile int*)((unsigned long long)p | (1ull << 62));
    *bad = 1;
}
