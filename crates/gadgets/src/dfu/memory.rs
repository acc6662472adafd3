//! Where the DFU device keeps what it "runs": the firmware image in FILE
//! (alternate setting 0, "flash") and a small option-byte block in RAM
//! (alternate setting 1, "option bytes").
//!
//! FILE is never opened through a symbolic link, and is replaced, never
//! written in place: manifestation writes a private (0600) temporary file
//! beside it, created with `O_EXCL | O_NOFOLLOW`, syncs it, reads it back to
//! verify it, and renames it over FILE. Renaming replaces a link planted at
//! FILE rather than following it, and a reader (or a crash) sees the old
//! image or the new one, never half of each.

use std::fs::{File, OpenOptions};
use std::io::{self, Read as _, Seek as _, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};
use tracing::{info, warn};

use super::ids::{DFU_PRODUCT_ID, RUNTIME_PRODUCT_ID};
use super::machine::{DfuStatus, Memory};
use crate::identity::VENDOR_ID;

/// Alternate setting of the firmware image.
pub const FLASH_ALT: u8 = 0;
/// Alternate setting of the option bytes.
pub const OPTION_BYTES_ALT: u8 = 1;
/// The option bytes: eight values, each followed by its complement (as
/// STM32 option bytes are stored), so a block that fails the check is errVERIFY.
pub const OPTION_BYTES_LEN: usize = 16;

/// The option bytes a device starts with: read protection off (0xaa), the rest erased.
const DEFAULT_OPTION_VALUES: [u8; OPTION_BYTES_LEN / 2] = [0xaa, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff];

/// The firmware in FILE and the option bytes in RAM (see the module docs).
#[derive(Clone, Debug)]
pub struct FileMemory {
    path: PathBuf,
    capacity: usize,
    option_bytes: [u8; OPTION_BYTES_LEN],
}

impl FileMemory {
    pub(super) fn new(path: PathBuf, capacity: usize) -> Self {
        let mut option_bytes = [0; OPTION_BYTES_LEN];
        for (pair, value) in option_bytes.chunks_exact_mut(2).zip(DEFAULT_OPTION_VALUES) {
            pair.copy_from_slice(&[value, !value]);
        }
        Self { path, capacity, option_bytes }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The image in FILE (empty if there is none yet).
    pub fn firmware(&self) -> io::Result<Vec<u8>> {
        read_image(&self.path, self.capacity)
    }
}

impl Memory for FileMemory {
    fn capacity(&self, alt: u8) -> usize {
        match alt {
            FLASH_ALT => self.capacity,
            OPTION_BYTES_ALT => OPTION_BYTES_LEN,
            _ => 0,
        }
    }

    fn is_complete(&self, alt: u8, len: usize) -> bool {
        alt != OPTION_BYTES_ALT || len == OPTION_BYTES_LEN
    }

    fn read(&mut self, alt: u8) -> Result<Vec<u8>, DfuStatus> {
        match alt {
            FLASH_ALT => self.firmware().map_err(|error| {
                warn!(path = %self.path.display(), %error, "cannot read the firmware image for an upload");
                DfuStatus::ERR_FILE
            }),
            OPTION_BYTES_ALT => Ok(self.option_bytes.to_vec()),
            _ => Err(DfuStatus::ERR_ADDRESS),
        }
    }

    fn program(&mut self, alt: u8, image: &[u8]) -> Result<(), DfuStatus> {
        match alt {
            FLASH_ALT => {
                if suffix_names_another_device(image) {
                    warn!("the image's DFU suffix names another device; not programmed");
                    return Err(DfuStatus::ERR_TARGET);
                }
                write_atomically(&self.path, image).map_err(|error| {
                    warn!(path = %self.path.display(), %error, "cannot write the firmware image");
                    match error {
                        WriteError::Verify => DfuStatus::ERR_VERIFY,
                        WriteError::Io(_) => DfuStatus::ERR_WRITE,
                    }
                })?;
                info!(path = %self.path.display(), bytes = image.len(), sha256 = %hex(&sha256(image)), "firmware written");
                Ok(())
            }
            OPTION_BYTES_ALT => {
                let pairs_hold = image.len() == OPTION_BYTES_LEN && image.chunks_exact(2).all(|p| p[1] == !p[0]);
                if !pairs_hold {
                    return Err(DfuStatus::ERR_VERIFY);
                }
                self.option_bytes.copy_from_slice(image);
                Ok(())
            }
            _ => Err(DfuStatus::ERR_ADDRESS),
        }
    }
}

/// Reads the image at `path` without following a link: empty if there is no
/// file, an error if it is not a regular file or holds more than `capacity` bytes.
pub(super) fn read_image(path: &Path, capacity: usize) -> io::Result<Vec<u8>> {
    let file = match OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) if error.raw_os_error() == Some(libc::ELOOP) => {
            return Err(io::Error::other("it is a symbolic link; refusing to follow it"));
        }
        Err(error) => return Err(error),
    };
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::other("it is not a regular file"));
    }
    if meta.len() > capacity as u64 {
        return Err(io::Error::other(format!(
            "it holds {} bytes, more than the {capacity} the device has",
            meta.len()
        )));
    }
    let mut image = Vec::with_capacity(meta.len() as usize);
    // One more byte than allowed: a file that grew since the metadata is caught too.
    (&file).take(capacity as u64 + 1).read_to_end(&mut image)?;
    if image.len() > capacity {
        return Err(io::Error::other(format!("it holds more than the {capacity} bytes the device has")));
    }
    Ok(image)
}

#[derive(Debug, thiserror::Error)]
enum WriteError {
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error("the written image does not read back the same")]
    Verify,
}

/// Replaces `path` with `image` as the module docs say.
fn write_atomically(path: &Path, image: &[u8]) -> Result<(), WriteError> {
    let (dir, mut temp, temp_path) = create_temp_beside(path)?;
    let result = (|| {
        temp.write_all(image)?;
        temp.sync_all()?;
        temp.rewind()?;
        let mut back = Vec::with_capacity(image.len());
        temp.read_to_end(&mut back)?;
        if sha256(&back) != sha256(image) {
            return Err(WriteError::Verify);
        }
        std::fs::rename(&temp_path, path)?;
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temp_path);
        return result;
    }
    // The rename is durable once the directory is.
    File::open(&dir)?.sync_all()?;
    Ok(())
}

/// A new private file in `path`'s directory, named after it.
pub(super) fn create_temp_beside(path: &Path) -> io::Result<(PathBuf, File, PathBuf)> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path.file_name().ok_or_else(|| io::Error::other("the path names no file"))?;
    for attempt in 0..64u32 {
        let mut temp_name = std::ffi::OsString::from(".");
        temp_name.push(name);
        temp_name.push(format!(".{}.{attempt}.dfu-tmp", std::process::id()));
        let temp_path = dir.join(temp_name);
        match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&temp_path)
        {
            Ok(file) => return Ok((dir, file, temp_path)),
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(error) => return Err(error),
        }
    }
    Err(io::Error::other("64 temporary files are in the way; remove the .*.dfu-tmp files beside it"))
}

/// Whether `image` ends in a DFU suffix (DFU 1.1 appendix B: bcdDevice,
/// idProduct, idVendor, bcdDFU, "UFD", bLength 16, dwCRC) naming a vendor or
/// product other than ours (0xffff matches any).
fn suffix_names_another_device(image: &[u8]) -> bool {
    let Some(suffix) = image.len().checked_sub(16).map(|at| &image[at..]) else { return false };
    if &suffix[8..11] != b"UFD" || suffix[11] != 16 {
        return false;
    }
    let product = u16::from_le_bytes([suffix[2], suffix[3]]);
    let vendor = u16::from_le_bytes([suffix[4], suffix[5]]);
    let vendor_fits = vendor == 0xffff || vendor == VENDOR_ID;
    let product_fits = matches!(product, 0xffff | RUNTIME_PRODUCT_ID | DFU_PRODUCT_ID);
    !(vendor_fits && product_fits)
}

pub(super) fn sha256(data: &[u8]) -> [u8; 32] {
    Sha256::digest(data).into()
}

pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    /// An empty directory for one test, removed when the guard is dropped.
    fn scratch(name: &str) -> tempfile::TempDir {
        tempfile::Builder::new().prefix(&format!("usbwire-dfu-memory-{name}-")).tempdir().unwrap()
    }

    #[test]
    fn programming_replaces_the_file_privately_and_leaves_no_temporary() {
        let dir = scratch("replace");
        let dir = dir.path();
        let path = dir.join("fw.bin");
        std::fs::write(&path, b"old").unwrap();
        let mut memory = FileMemory::new(path.clone(), 1024);
        memory.program(FLASH_ALT, b"new image").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new image");
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read_dir(dir).unwrap().count(), 1, "only FILE is left");
        assert_eq!(memory.read(FLASH_ALT).unwrap(), b"new image");
    }

    #[test]
    fn a_link_planted_at_file_is_replaced_not_followed() {
        let dir = scratch("link");
        let dir = dir.path();
        let victim = dir.join("victim");
        std::fs::write(&victim, b"keep me").unwrap();
        let path = dir.join("fw.bin");
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        let mut memory = FileMemory::new(path.clone(), 1024);
        assert_eq!(memory.read(FLASH_ALT), Err(DfuStatus::ERR_FILE), "not read through the link");
        memory.program(FLASH_ALT, b"image").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
        assert!(std::fs::symlink_metadata(&path).unwrap().is_file());
        // A link planted where the temporary file goes is not followed either.
        let temp_name = format!(".fw.bin.{}.0.dfu-tmp", std::process::id());
        std::os::unix::fs::symlink(&victim, dir.join(temp_name)).unwrap();
        memory.program(FLASH_ALT, b"image 2").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
        assert_eq!(std::fs::read(&path).unwrap(), b"image 2");
    }

    #[test]
    fn a_missing_file_is_empty_firmware_and_an_oversized_one_is_an_error() {
        let dir = scratch("sizes");
        let dir = dir.path();
        let path = dir.join("fw.bin");
        assert_eq!(read_image(&path, 8).unwrap(), Vec::<u8>::new());
        std::fs::write(&path, [0u8; 9]).unwrap();
        assert!(read_image(&path, 8).unwrap_err().to_string().contains("more than the 8"));
        assert!(read_image(dir, 8).is_err(), "a directory is not an image");
    }

    #[test]
    fn a_failed_write_is_err_write_and_leaves_what_was_there() {
        let dir = scratch("write-fails");
        let dir = dir.path();
        // A directory where FILE goes: the rename fails, even for root.
        let path = dir.join("fw.bin");
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("inside"), b"old").unwrap();
        let mut memory = FileMemory::new(path.clone(), 1024);
        assert_eq!(memory.program(FLASH_ALT, b"new"), Err(DfuStatus::ERR_WRITE));
        assert_eq!(std::fs::read(path.join("inside")).unwrap(), b"old");
        assert_eq!(std::fs::read_dir(dir).unwrap().count(), 1, "the temporary file is removed");
    }

    #[test]
    fn a_suffix_naming_another_device_is_err_target() {
        let dir = scratch("suffix");
        let dir = dir.path();
        let mut memory = FileMemory::new(dir.join("fw.bin"), 1024);
        let with_suffix = |vendor: u16, product: u16| {
            let mut image = b"firmware".to_vec();
            image.extend_from_slice(&[0xff, 0xff]);
            image.extend_from_slice(&product.to_le_bytes());
            image.extend_from_slice(&vendor.to_le_bytes());
            image.extend_from_slice(&[0x00, 0x01, b'U', b'F', b'D', 16, 0, 0, 0, 0]);
            image
        };
        assert_eq!(memory.program(FLASH_ALT, &with_suffix(0x0483, 0xdf11)), Err(DfuStatus::ERR_TARGET));
        assert_eq!(memory.program(FLASH_ALT, &with_suffix(VENDOR_ID, 0x0001)), Err(DfuStatus::ERR_TARGET));
        assert_eq!(memory.program(FLASH_ALT, &with_suffix(VENDOR_ID, RUNTIME_PRODUCT_ID)), Ok(()));
        assert_eq!(memory.program(FLASH_ALT, &with_suffix(0xffff, 0xffff)), Ok(()));
    }

    #[test]
    fn option_bytes_need_every_complement_and_all_sixteen_bytes() {
        let mut memory = FileMemory::new(PathBuf::from("/nonexistent/fw.bin"), 1024);
        let defaults = memory.read(OPTION_BYTES_ALT).unwrap();
        assert_eq!(&defaults[..2], &[0xaa, 0x55]);
        let mut bytes = [0u8; OPTION_BYTES_LEN];
        for (i, pair) in bytes.chunks_exact_mut(2).enumerate() {
            pair.copy_from_slice(&[i as u8, !(i as u8)]);
        }
        assert!(!memory.is_complete(OPTION_BYTES_ALT, 15));
        assert!(memory.is_complete(OPTION_BYTES_ALT, 16) && memory.is_complete(FLASH_ALT, 3));
        let mut broken = bytes;
        broken[5] ^= 1;
        assert_eq!(memory.program(OPTION_BYTES_ALT, &broken), Err(DfuStatus::ERR_VERIFY));
        assert_eq!(memory.read(OPTION_BYTES_ALT).unwrap(), defaults, "unchanged");
        memory.program(OPTION_BYTES_ALT, &bytes).unwrap();
        assert_eq!(memory.read(OPTION_BYTES_ALT).unwrap(), bytes);
    }
}
