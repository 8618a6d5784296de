//! `cowork-helper image build`: builds our Debian userland (`rootfs.img`,
//! the read-only ext4 root the VM's sessions run in) on a machine that has
//! the helper but no client bundle, typically an installed package (which
//! ships the kernel and initramfs but not this 600 MiB disk).
//!
//! The recipe is `scripts/mkrootfs.sh`, embedded in the binary with the
//! library it sources, so a checkout's `scripts/setup.sh` and an installed
//! helper build the same image: mmdebstrap (root mode as root, unshare mode
//! otherwise) from the Debian archive of the host's apt sources (or
//! `--mirror`), packed with `mkfs.ext4 -d`. Progress goes to stderr; the
//! image's path is the one line on stdout.
//!
//! Where it goes (see [`crate::backend::image::ImageSearch`], which finds
//! it there): as root `/var/lib/cowork-helper/userland/`, else
//! `<data dir>/userland/`. The build cache (mmdebstrap's result, reused
//! offline by later builds) is `--cache` (`$COWORK_GUEST_CACHE`), else
//! `/var/cache/cowork-helper` as root, else `$XDG_CACHE_HOME/cowork-helper`.
//! The command line and the environment are read by [`crate::cli`]; this
//! module takes them as [`Options`].
//!
//! Limits: amd64 only (the guest kernel is); the first build needs the
//! Debian archive and about 100 MiB of downloads, and a few minutes.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::backend::image::{ROOTFS_FILE, STATE_DIR, USERLAND_DIR_NAME};
use crate::hostfs::HostEnv;

/// The userland recipe, run from a private copy.
const MKROOTFS: &str = include_str!("../scripts/mkrootfs.sh");
/// The library the recipe sources (`lib/common.sh` beside it).
const COMMON: &str = include_str!("../scripts/lib/common.sh");
/// Environment variable of `image build --cache`, naming the build cache
/// (shared with the scripts); read by [`crate::cli`].
pub const CACHE_ENV: &str = "COWORK_GUEST_CACHE";
/// Root's build cache.
const SYSTEM_CACHE: &str = "/var/cache/cowork-helper";
/// The keyring mmdebstrap verifies Debian's archive with.
const DEBIAN_KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

/// What `image build` does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// The directory `rootfs.img` goes to.
    pub output: PathBuf,
    /// The build cache.
    pub cache: PathBuf,
    pub mirror: Option<String>,
    pub refresh: bool,
    /// mmdebstrap, when found on the helper's `PATH`.
    pub mmdebstrap: Option<PathBuf>,
    /// Where the recipe's private copy goes (the temporary directory).
    pub temp_dir: PathBuf,
}

/// Why the build did not start or did not finish.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("{tool} is not installed: {fix}")]
    Missing {
        tool: &'static str,
        fix: &'static str,
    },
    #[error("cannot prepare {path}: {source}")]
    Prepare { path: PathBuf, source: io::Error },
    #[error("cannot run bash: {0}")]
    Run(io::Error),
    #[error("the build failed ({0}); its messages are above")]
    Failed(std::process::ExitStatus),
    #[error("the build reported no image (its output: {0:?})")]
    NoImage(String),
}

impl Options {
    /// The options for the given flags (`cache`: `--cache` or
    /// [`CACHE_ENV`]; empty means unset); unset ones take the defaults of
    /// the module doc (as root or not, `data_dir` for a user, `host`'s
    /// cache directory).
    pub fn new(
        output: Option<PathBuf>,
        cache: Option<PathBuf>,
        mirror: Option<String>,
        refresh: bool,
        data_dir: &Path,
        host: &HostEnv,
    ) -> Options {
        // SAFETY: geteuid cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        let output = output.unwrap_or_else(|| {
            if root {
                Path::new(STATE_DIR).join(USERLAND_DIR_NAME)
            } else {
                data_dir.join(USERLAND_DIR_NAME)
            }
        });
        let cache = cache
            .filter(|c| !c.as_os_str().is_empty())
            .unwrap_or_else(|| default_cache(root, host));
        Options {
            output,
            cache,
            mirror,
            refresh,
            mmdebstrap: host.on_path("mmdebstrap"),
            temp_dir: host.temp_dir.clone(),
        }
    }
}

/// Root's cache, else the user's (`$XDG_CACHE_HOME`, `~/.cache`), else one
/// in the temporary directory.
fn default_cache(root: bool, host: &HostEnv) -> PathBuf {
    if root {
        return PathBuf::from(SYSTEM_CACHE);
    }
    host.cache_dir()
        .map(|d| d.join("cowork-helper"))
        .unwrap_or_else(|| host.temp_dir.join("cowork-helper-cache"))
}

/// A private directory holding the recipe; removed when dropped.
struct Recipe {
    dir: PathBuf,
}

impl Recipe {
    /// Writes the recipe into a new private directory under `temp_dir`.
    fn write(temp_dir: &Path) -> Result<Recipe, BuildError> {
        let dir = temp_dir.join(format!(
            "cowork-helper-image-build-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0)
        ));
        let prepare = |source| BuildError::Prepare {
            path: dir.clone(),
            source,
        };
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(prepare)?;
        let recipe = Recipe { dir: dir.clone() };
        fs::create_dir_all(dir.join("scripts/lib")).map_err(prepare)?;
        fs::write(dir.join("scripts/lib/common.sh"), COMMON).map_err(prepare)?;
        fs::write(recipe.script(), MKROOTFS).map_err(prepare)?;
        Ok(recipe)
    }

    fn script(&self) -> PathBuf {
        self.dir.join("scripts/mkrootfs.sh")
    }
}

impl Drop for Recipe {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Builds the userland; returns the image's path.
pub fn build(opts: &Options) -> Result<PathBuf, BuildError> {
    if opts.mmdebstrap.is_none() {
        return Err(BuildError::Missing {
            tool: "mmdebstrap",
            fix: "sudo apt install mmdebstrap (and uidmap to build as a user)",
        });
    }
    if !Path::new(DEBIAN_KEYRING).is_file() {
        return Err(BuildError::Missing {
            tool: "debian-archive-keyring",
            fix: "sudo apt install debian-archive-keyring (mmdebstrap verifies the Debian archive with it)",
        });
    }
    for dir in [&opts.output, &opts.cache] {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(|source| BuildError::Prepare {
                path: dir.clone(),
                source,
            })?;
    }
    let recipe = Recipe::write(&opts.temp_dir)?;
    let mut cmd = Command::new("bash");
    cmd.arg(recipe.script())
        .arg("--output")
        .arg(&opts.output)
        .arg("--cache")
        .arg(&opts.cache);
    if let Some(m) = &opts.mirror {
        cmd.arg("--mirror").arg(m);
    }
    if opts.refresh {
        cmd.arg("--refresh");
    }
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(BuildError::Run)?;
    if !out.status.success() {
        return Err(BuildError::Failed(out.status));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let image = text
        .lines()
        .find_map(|l| l.strip_prefix("ROOTFS="))
        .map(PathBuf::from)
        .filter(|p| p.file_name() == Some(ROOTFS_FILE.as_ref()) && p.is_file())
        .ok_or_else(|| BuildError::NoImage(text.to_string()))?;
    // Every user's helper reads the system-wide image.
    let _ = fs::set_permissions(&image, fs::Permissions::from_mode(0o644));
    Ok(image)
}

/// `image build`'s entry: progress on stderr, the image's path on stdout.
pub fn main(opts: &Options) -> i32 {
    let started = Instant::now();
    eprintln!(
        "image build: building the Debian userland into {} (cache {}; the first build downloads about 100 MiB and takes a few minutes)",
        opts.output.display(),
        opts.cache.display()
    );
    match build(opts) {
        Ok(image) => {
            let mib = fs::metadata(&image).map(|m| m.len() >> 20).unwrap_or(0);
            eprintln!(
                "image build: done in {:.0} s: {} ({mib} MiB); `cowork-helper doctor` shows which userland a VM gets",
                started.elapsed().as_secs_f64(),
                image.display()
            );
            println!("{}", image.display());
            0
        }
        Err(e) => {
            eprintln!("cowork-helper image build: {e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_recipe_is_the_checkouts() {
        assert!(MKROOTFS.contains("source \"$(dirname \"${BASH_SOURCE[0]}\")/lib/common.sh\""));
        let recipe = Recipe::write(&std::env::temp_dir()).unwrap();
        let dir = recipe.dir.clone();
        assert_eq!(fs::read_to_string(recipe.script()).unwrap(), MKROOTFS);
        let help = Command::new("bash")
            .arg(recipe.script())
            .arg("--help")
            .output()
            .unwrap();
        assert!(help.status.success(), "{help:?}");
        assert!(String::from_utf8_lossy(&help.stdout).contains("mmdebstrap"));
        drop(recipe);
        assert!(!dir.exists(), "the private copy is removed");
    }

    #[test]
    fn defaults_follow_the_user() {
        let data = Path::new("/home/u/.local/share/cowork-helper");
        let host = HostEnv {
            home: Some("/home/u".into()),
            temp_dir: "/t".into(),
            ..HostEnv::default()
        };
        let o = Options::new(None, Some("/c".into()), None, false, data, &host);
        // SAFETY: geteuid takes no arguments and cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        let want = if root {
            PathBuf::from("/var/lib/cowork-helper/userland")
        } else {
            data.join("userland")
        };
        assert_eq!(o.output, want);
        assert_eq!(o.cache, PathBuf::from("/c"));
        let o = Options::new(
            Some("/o".into()),
            Some("/c".into()),
            Some("http://m".into()),
            true,
            data,
            &host,
        );
        assert_eq!(o.output, PathBuf::from("/o"));
        assert!(o.refresh);
        // No --cache (or an empty COWORK_GUEST_CACHE): the user's cache.
        let o = Options::new(None, Some("".into()), None, false, data, &host);
        if !root {
            assert_eq!(o.cache, PathBuf::from("/home/u/.cache/cowork-helper"));
            let host = HostEnv {
                cache_home: Some("/x".into()),
                ..host.clone()
            };
            let o = Options::new(None, None, None, false, data, &host);
            assert_eq!(o.cache, PathBuf::from("/x/cowork-helper"));
            let o = Options::new(None, None, None, false, data, &HostEnv::default());
            assert_eq!(o.cache, PathBuf::from("/tmp/cowork-helper-cache"));
        }
    }
}
