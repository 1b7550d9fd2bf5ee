// Transparent huge pages for weights (hugepage.c).
#ifndef MESHNODE_HUGEPAGE_H
#define MESHNODE_HUGEPAGE_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

// meshnode_advise_huge asks the kernel to back the whole 2 MiB pages inside
// [p, p+n) with transparent huge pages when they are first touched. Call it
// before writing the memory. A no-op where the system has no such advice.
void meshnode_advise_huge(void * p, size_t n);

#ifdef __cplusplus
}
#endif

#endif
