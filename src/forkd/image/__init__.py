"""Guest images: a Debian kernel, a small initramfs and an ext4 root file system with the forkd agent.

``forkd.image.builder`` is the API (:func:`build_image`, :func:`list_images`, :func:`load_image`,
:func:`remove_image`); see docs/images.md for what goes into an image and how it is cached.
"""
