/*
 * gguf_writer: a streaming writer of one GGUF v3 file (model-spec section 1).
 *
 * A file is written in three phases, in this order:
 *   1. metadata (gguf_writer_add_*) and tensor infos (gguf_writer_add_tensor),
 *      each kept in the order added, which is the order in the file;
 *   2. gguf_writer_write_header(): header, KV records, tensor infos, zero
 *      padding up to the alignment;
 *   3. the bytes of every tensor, in info order, through
 *      gguf_writer_write_data() in pieces of any size; a piece may span
 *      several tensors. When a tensor's last byte arrives the writer pads it
 *      with zeros to the alignment, so offsets are those of llama.cpp's
 *      writer (offset += pad(nbytes, alignment)).
 * gguf_writer_finish() then checks that every byte was written, flushes and
 * closes the file.
 *
 * Inputs are checked, not trusted: keys 1..255 bytes and unique; tensor names
 * 1..63 bytes and unique; known tensor types; n_dims 1..4, every ne >= 1,
 * ne[0] a multiple of the type's block size; sizes that do not overflow; data
 * totals equal to the declared sizes. A bad input returns -EINVAL with one
 * log line and leaves the writer usable (the bad record or piece is not
 * written); finishing with bytes missing fails the writer. An I/O failure
 * (ENOSPC, EIO, ...) returns its negative errno, logged
 * with the path and the file offset, and fails the writer: every later call
 * returns the same code. Calling an operation in the wrong phase is a bug of
 * the caller and hits ASSERT.
 *
 * Output goes through one large buffer (cfg->buffer_bytes); pieces at least
 * that large bypass it. With cfg->direct the file is written with O_DIRECT
 * (no page cache: much cheaper for multi-GB files, and it leaves other
 * processes' cached pages alone): everything then goes through the 4 KiB-
 * aligned buffer and is written in whole 4 KiB blocks, the tail at finish
 * without O_DIRECT; a file system that refuses O_DIRECT gets normal writes.
 * Host byte order must be little-endian.
 *
 * Threading: a writer is used by one thread at a time.
 */
#ifndef MODEL_GGUF_WRITER_H
#define MODEL_GGUF_WRITER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define GGUF_WRITER_MAX_KEY 255                 /* longest key, bytes */
#define GGUF_WRITER_DEFAULT_BUFFER (8u << 20)   /* output buffer, bytes */

struct gguf_writer_config {
    const char *path;      /* file to create or truncate; copied */
    uint32_t alignment;    /* bytes; a power of two >= 8; 0 = 32 (GGUF default) */
    size_t buffer_bytes;   /* output buffer size, bytes; 0 = GGUF_WRITER_DEFAULT_BUFFER;
                              rounded up to 4 KiB with direct */
    bool direct;           /* bypass the page cache (O_DIRECT) where possible; default false */
};

struct gguf_writer;

/* Creates (or truncates) cfg->path and allocates the output buffer. Returns an
 * owned writer, or NULL after logging why (bad config, open failed, no
 * memory). */
struct gguf_writer *gguf_writer_create(const struct gguf_writer_config *cfg);

/* Closes the file and frees everything; accepts NULL. A writer that has not
 * finished successfully removes its partial file, so no truncated GGUF is
 * left under the final name. */
void gguf_writer_destroy(struct gguf_writer *w);

/* Phase 1: metadata. Each adds one KV record at the end of the list. Return 0,
 * -EINVAL (bad or duplicate key, a general.alignment that is not a uint32
 * equal to cfg->alignment), -ENOMEM, or the writer's earlier failure. Strings
 * are NUL-terminated, copied, and written without the NUL. */
int gguf_writer_add_u8(struct gguf_writer *w, const char *key, uint8_t v);
int gguf_writer_add_i8(struct gguf_writer *w, const char *key, int8_t v);
int gguf_writer_add_u16(struct gguf_writer *w, const char *key, uint16_t v);
int gguf_writer_add_i16(struct gguf_writer *w, const char *key, int16_t v);
int gguf_writer_add_u32(struct gguf_writer *w, const char *key, uint32_t v);
int gguf_writer_add_i32(struct gguf_writer *w, const char *key, int32_t v);
int gguf_writer_add_u64(struct gguf_writer *w, const char *key, uint64_t v);
int gguf_writer_add_i64(struct gguf_writer *w, const char *key, int64_t v);
int gguf_writer_add_f32(struct gguf_writer *w, const char *key, float v);
int gguf_writer_add_f64(struct gguf_writer *w, const char *key, double v);
int gguf_writer_add_bool(struct gguf_writer *w, const char *key, bool v);
int gguf_writer_add_str(struct gguf_writer *w, const char *key, const char *v);

/* An array of n numbers or bools: elem_type is a scalar enum gguf_type other
 * than STRING and ARRAY, values points to n elements of the matching C type
 * (uint8_t ... double; bool as one byte 0 or 1), borrowed for the call.
 * Returns as the scalar adders, and -EINVAL for a bad elem_type or a bool
 * element other than 0/1. */
int gguf_writer_add_array(struct gguf_writer *w, const char *key, uint32_t elem_type,
                          const void *values, uint64_t n);

/* An array of n NUL-terminated strings, borrowed for the call. */
int gguf_writer_add_array_str(struct gguf_writer *w, const char *key, const char *const *strs,
                              uint64_t n);

/* Phase 1: declares the next tensor: name (copied), type (enum quant_type),
 * n_dims 1..4 and ne[0..n_dims-1] (fastest first). Its offset is the padded
 * end of the tensor declared before it. Returns 0, -EINVAL (bad or duplicate
 * name, unknown type, bad dims, ne[0] not a multiple of the block size, size
 * overflow), -ENOMEM, or the writer's earlier failure. */
int gguf_writer_add_tensor(struct gguf_writer *w, const char *name, uint32_t type,
                           uint32_t n_dims, const int64_t *ne);

/* Tensors declared so far, and the data bytes of tensor i (i < n, ASSERTed). */
uint64_t gguf_writer_n_tensors(const struct gguf_writer *w);
uint64_t gguf_writer_tensor_nbytes(const struct gguf_writer *w, uint64_t i);

/* Bytes of the data section declared so far (padded sizes summed). */
uint64_t gguf_writer_data_size(const struct gguf_writer *w);

/* Phase 2: writes the header, KV records, tensor infos and padding. When
 * cfg->alignment is not 32 and no general.alignment was added, adds it
 * (uint32) first. Ends phase 1. Returns 0, an I/O error, or -ENOMEM. */
int gguf_writer_write_header(struct gguf_writer *w);

/* Phase 3: appends n bytes (borrowed for the call) to the data section,
 * continuing the current tensor and moving on to the next ones as each fills
 * up. Returns 0, -EINVAL (more bytes than the declared tensors still hold;
 * logged with the current tensor's name; nothing of the piece is written), or
 * an I/O error. */
int gguf_writer_write_data(struct gguf_writer *w, const void *data, uint64_t n);

/* Bytes written to the file so far, buffered ones included. */
uint64_t gguf_writer_file_offset(const struct gguf_writer *w);

/* Checks that every declared tensor got all its bytes (-EINVAL naming the
 * first short tensor otherwise), flushes, and closes the file (close errors
 * are reported: -EIO, -ENOSPC, ...). After 0 the file is complete and stays
 * when the writer is destroyed. Returns the writer's earlier failure if any. */
int gguf_writer_finish(struct gguf_writer *w);

#endif
