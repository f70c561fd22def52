/*
 * Lets sealfs decline FUSE connection capabilities that libfuse asks the kernel
 * for by default and that pyfuse3 (3.5) gives no way to decline.
 *
 * Why (docs/design.md, "POSIX details decided by tests"): on a writable mount,
 * auto_inval_data makes the kernel drop a file's page cache when a read finds
 * its mtime changed, racing with another process's write whose bytes are in
 * that cache but not yet in the daemon (a tailer read NULs); atomic_o_trunc
 * makes an open with O_TRUNC truncate without the inode lock a write(2) holds,
 * so the truncation could land between two requests of one write.
 *
 * How: this library is loaded with RTLD_GLOBAL before pyfuse3, so its
 * fuse_session_new comes first in the lookup scope of pyfuse3's references
 * (which carry no more than the base version FUSE_3.0). It calls libfuse's own
 * with a copy of the operations whose init callback runs pyfuse3's, then
 * clears the declined bits from what the connection wants. Nothing else of
 * libfuse or pyfuse3 is touched.
 */
#define _GNU_SOURCE
#define FUSE_USE_VERSION 35
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <fuse_lowlevel.h>

typedef struct fuse_session *(*session_new_fn)(struct fuse_args *,
                                              const struct fuse_lowlevel_ops *,
                                              size_t, void *);

static unsigned declined;
static int interposed;
static void (*wrapped_init)(void *, struct fuse_conn_info *);

/* Whether the next session declines the two capabilities (a writable mount) or
 * keeps libfuse's defaults (a read-only one, which follows changes made elsewhere). */
void sealfs_decline_for_writes(int writable)
{
    declined = writable ? FUSE_CAP_AUTO_INVAL_DATA | FUSE_CAP_ATOMIC_O_TRUNC : 0;
}

/* Whether fuse_session_new went through here (else nothing was declined). */
int sealfs_interposed(void)
{
    return interposed;
}

static void init_declining(void *userdata, struct fuse_conn_info *conn)
{
    if (wrapped_init)
        wrapped_init(userdata, conn);
    conn->want &= ~declined;
}

struct fuse_session *fuse_session_new(struct fuse_args *args,
                                      const struct fuse_lowlevel_ops *op,
                                      size_t op_size, void *userdata)
{
    void *libfuse = dlopen("libfuse3.so.3", RTLD_LAZY | RTLD_NOLOAD);
    if (!libfuse)
        return NULL;
    session_new_fn real = (session_new_fn)dlvsym(libfuse, "fuse_session_new", "FUSE_3.0");
    dlclose(libfuse); /* still loaded: the caller links against it */
    if (!real)
        return NULL;
    /* libfuse copies the operations into the session; this copy only has to
     * outlive the call. op_size may exceed this header's struct (newer
     * headers): the bytes past it are copied as they are. */
    size_t size = op_size > sizeof(struct fuse_lowlevel_ops) ? op_size
                                                             : sizeof(struct fuse_lowlevel_ops);
    struct fuse_lowlevel_ops *copy = calloc(1, size);
    if (!copy)
        return NULL;
    memcpy(copy, op, op_size);
    wrapped_init = copy->init;
    copy->init = init_declining;
    interposed = 1;
    struct fuse_session *session = real(args, copy, op_size, userdata);
    free(copy);
    return session;
}
